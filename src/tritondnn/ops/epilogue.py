"""The fused GEMM epilogue: one description shared by matmul, convolution and the graph API.

A matrix product ``acc = A @ B`` (accumulated in fp32, fp64 for fp64 operands) leaves the kernel as

    pre = alpha * acc + beta * C + bias        (C optional; bias per column or per row, optional)
    out = act(pre) + residual                  (activation and residual optional)

cast to the output dtype, with ``pre`` optionally stored too (the activation's backward needs it).
``beta * C`` comes before the activation (ResNet's ``relu(conv + identity)``), the residual after
it (a transformer's ``x + gelu(x @ W)``), so both patterns fuse. cuBLASLt's bias/GELU/aux
epilogues are the special cases without C or residual.

``Epilogue`` is the host-side description (frozen, hashable: it keys plans and graphs);
``apply_epilogue`` is the jitted function a GEMM kernel calls on its accumulator tile.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from ..core.checks import FLOAT_DTYPES, check_choice, check_dtype, check_float
from ..core.numerics import convert
from .activation import Activation, activation_value

BIAS_KINDS = ("none", "col", "row")  # 0, 1, 2 in kernels: none, bias[n] added to every row, bias[m]
ACTIVATIONS = tuple(a.name.lower() for a in Activation)
# (p0, p1) when none are given: relu without slope or clip, elu alpha 1, swish beta 1, softplus
# beta 1 threshold 20 (the torch.nn.functional defaults). See ``Activation`` for their meaning.
_DEFAULT_PARAMS = {
    Activation.RELU: (0.0, math.inf),
    Activation.ELU: (1.0, 0.0),
    Activation.SILU: (1.0, 0.0),
    Activation.SOFTPLUS: (1.0, 20.0),
}
NO_ACTIVATION = -1  # the ``ACT`` constexpr for none


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What a GEMM does to its accumulator before storing it (see the module docstring).

    Attributes:
        alpha: scale of the product.
        beta: scale of the ``C`` input; non-zero means a ``C`` tensor is read.
        bias: ``"none"``, ``"col"`` (a vector of length N added to every row, as ``F.linear``'s
            bias) or ``"row"`` (a vector of length M added to every column, a conv's per-channel
            bias when channels are rows).
        activation: an ``Activation`` name (``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``,
            ...) or None.
        activation_params: ``(p0,)`` or ``(p0, p1)`` as listed in ``Activation``; empty for the
            torch.nn.functional defaults.
        residual: a residual tensor is added after the activation.
        store_preactivation: also write ``pre``, for the backward pass (in the wider of the
            operands' and the output's dtypes).
        out_dtype: the output dtype; None for the operation's default.
    """

    alpha: float = 1.0
    beta: float = 0.0
    bias: str = "none"
    activation: str | None = None
    activation_params: tuple[float, ...] = ()
    residual: bool = False
    store_preactivation: bool = False
    out_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        op = "tdnn.Epilogue"
        object.__setattr__(self, "alpha", check_float(op, "alpha", self.alpha))
        object.__setattr__(self, "beta", check_float(op, "beta", self.beta))
        check_choice(op, "bias", self.bias, BIAS_KINDS)
        if self.activation is not None:
            check_choice(op, "activation", self.activation, ACTIVATIONS)
        params = self.activation_params
        if not isinstance(params, tuple) or len(params) > 2:
            raise ValueError(
                f"{op}: argument 'activation_params'={params!r}; accepted: a tuple of 0 to 2 numbers"
            )
        if params and self.activation is None:
            raise ValueError(f"{op}: argument 'activation_params' is given but 'activation' is None")
        floats = tuple(check_float(op, "activation_params", p, finite=False) for p in params)
        object.__setattr__(self, "activation_params", floats)
        for name in ("residual", "store_preactivation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"{op}: argument '{name}' must be a bool, got {type(getattr(self, name)).__name__}"
                )
        if self.out_dtype is not None:
            check_dtype(op, "out_dtype", self.out_dtype, FLOAT_DTYPES)

    @property
    def activation_kind(self) -> int:
        """The ``ACT`` constexpr: an ``Activation`` value, or ``NO_ACTIVATION``."""
        return NO_ACTIVATION if self.activation is None else Activation[self.activation.upper()].value

    @property
    def params(self) -> tuple[float, float]:
        """(p0, p1) of the activation, defaults filled in."""
        if self.activation is None:
            return (0.0, 0.0)
        default = _DEFAULT_PARAMS.get(Activation(self.activation_kind), (0.0, 0.0))
        given = self.activation_params
        return (given + default[len(given) :])[:2]  # type: ignore[return-value]

    @property
    def bias_kind(self) -> int:
        """The ``BIAS`` constexpr: 0 none, 1 per column, 2 per row."""
        return BIAS_KINDS.index(self.bias)


# ---------------------------------------------------------------------------------------------
# Kernel side.


@triton.jit
def apply_epilogue(
    acc, rows, cols, M, N,
    c_ptr, sc_m, sc_n, bias_ptr, s_bias, res_ptr, sr_m, sr_n, pre_ptr, sp_m, sp_n,
    alpha, beta, p0, p1,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr,
):  # fmt: skip
    """The epilogue of one output tile; returns ``act(pre) + residual`` in ``acc``'s dtype.

    acc: [BLOCK_M, BLOCK_N] accumulator; rows, cols: its [BLOCK_M] and [BLOCK_N] indices, valid
    below M and N. Pointers are already offset to this tile's matrix (its batch); each tensor's
    element (r, c) sits at ``ptr + r * s_m + c * s_n`` (strides 0 broadcast). ``s_bias`` steps the
    bias vector. Flags that are off leave their pointers unread (pass any tensor).
    BIAS: 0 none, 1 per column (bias[c]), 2 per row (bias[r]). ACT: an ``Activation`` or -1.
    """
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    x = acc * alpha
    if HAS_C:
        c = tl.load(c_ptr + rows[:, None] * sc_m + cols[None, :] * sc_n, mask=mask, other=0.0)
        x += beta * convert(c, acc.dtype)
    if BIAS == 1:
        x += convert(tl.load(bias_ptr + cols * s_bias, mask=col_ok, other=0.0), acc.dtype)[None, :]
    elif BIAS == 2:
        x += convert(tl.load(bias_ptr + rows * s_bias, mask=row_ok, other=0.0), acc.dtype)[:, None]
    if STORE_PRE:
        pre_ptrs = pre_ptr + rows[:, None] * sp_m + cols[None, :] * sp_n
        tl.store(pre_ptrs, convert(x, pre_ptr.dtype.element_ty), mask=mask)
    if ACT >= 0:
        x = activation_value(x, ACT, p0, p1)
    if RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * sr_m + cols[None, :] * sr_n, mask=mask, other=0.0)
        x += convert(r, acc.dtype)
    return x


@triton.jit
def reduce_amax(y, mask, amax_ptr):
    """amax_ptr[0] = max(amax_ptr[0], max |y|) over the masked tile (fp8 scaling recipes read it).

    An atomic maximum: the result does not depend on the order programs arrive in, so it is
    deterministic even though it is an atomic. ``amax_ptr`` must start at 0.
    """
    tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(y), 0.0)).to(tl.float32))
