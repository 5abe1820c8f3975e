"""The accuracy rule every test and the demo apply (ARCHITECTURE.md, "Testing").

An output is compared with a float64 reference. In low precision the bar is PyTorch's own error in
the same dtype: ``max|ours - ref| <= 2 * max|torch - ref| + atol(dtype) * scale``, where ``scale``
is ``max(1, max|ref|)``; in fp32 and fp64 the ``atol`` term alone is near 1e-5 (1e-10) relative.
NaNs and infinities must sit where the reference has them.
"""

from __future__ import annotations

import dataclasses

import torch

ATOL: dict[torch.dtype, float] = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    error: float  # max |ours - ref| over finite reference values
    bound: float  # what the error was allowed to be
    detail: str = ""

    def __bool__(self) -> bool:
        return self.ok


def max_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    """max |value - ref| over the elements where ``ref`` is finite (0 for none)."""
    finite = torch.isfinite(ref)
    if not bool(finite.any()):
        return 0.0
    return float((value.double() - ref.double())[finite].abs().max())


def check(ours: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor | None = None) -> Verdict:
    """Apply the rule to ``ours`` against the float64 reference ``ref`` (and PyTorch's result)."""
    if ours.shape != ref.shape:
        return Verdict(False, float("inf"), 0.0, f"shape {tuple(ours.shape)} != {tuple(ref.shape)}")
    ours64, ref64 = ours.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.equal(torch.isnan(ours64), torch.isnan(ref64)):
        return Verdict(False, float("nan"), 0.0, "NaNs differ from the reference's")
    inf = torch.isinf(ref64)
    if not torch.equal(ours64[inf], ref64[inf]) or bool(torch.isinf(ours64[~inf]).any()):
        return Verdict(False, float("inf"), 0.0, "infinities differ from the reference's")
    finite = torch.isfinite(ref64)
    scale = max(1.0, float(ref64[finite].abs().max())) if bool(finite.any()) else 1.0
    bound = ATOL[ours.dtype] * scale
    if torch_out is not None:
        bound += 2 * max_error(torch_out.detach().cpu(), ref64)
    error = max_error(ours64, ref64)
    return Verdict(error <= bound, error, bound)
