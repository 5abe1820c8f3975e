"""Convolution geometry: argument rules, the ``ConvProblem`` every engine reads, and layouts.

Every convolution is handled as a 3-D one: a 1-D (N, C, L) tensor is (N, C, 1, 1, L), a 2-D one
(N, C, 1, H, W). Tensors are read in place through their strides; ``strides5`` gives the strides
of that 5-D view. The output (and the epilogue's C, residual and pre-activation tensors, which
share its strides) is channels-last exactly when the input is (``channels_last``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from ...core.engine import Problem

Triple = tuple[int, int, int]
Strides5 = tuple[int, int, int, int, int]
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def itemsize(name: str) -> int:
    return _ITEMSIZE[name]


def strides5(t: torch.Tensor) -> Strides5:
    """Strides of ``t`` (N, C, *spatial) as the 5-D view (N, C, D, H, W); missing dims get 0."""
    s = t.stride()
    return (s[0], s[1], *((0,) * (5 - t.ndim)), *s[2:])  # type: ignore[return-value]


def pad3(values: Sequence[int], fill: int) -> Triple:
    """A per-spatial-dimension tuple widened to (D, H, W)."""
    return (*((fill,) * (3 - len(values))), *values)  # type: ignore[return-value]


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` (N, C, *spatial) keeps its channels innermost (NHWC, NDHWC, NLC): then the
    convolution's outputs and input gradients are channels-last too."""
    if x.ndim < 3 or x.shape[1] == 1:
        return False
    spatial = [x.stride(d) for d in range(2, x.ndim) if x.shape[d] != 1]
    if not spatial:
        return False
    return x.stride(1) == 1 and min(spatial) >= x.shape[1]


def empty_conv_tensor(
    shape: Sequence[int], dtype: torch.dtype, device: torch.device, last: bool
) -> torch.Tensor:
    """An uninitialized (N, C, *spatial) tensor, channels-last or contiguous (one allocation, no
    view on top: the training step's host time counts each call)."""
    shape = tuple(shape)
    if not last:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, channels_last_strides_of(shape), dtype=dtype, device=device)


def channels_last_strides_of(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a dense (N, C, *spatial) tensor with its channels innermost."""
    c = shape[1]
    strides = [1] * len(shape)
    step = c
    for d in range(len(shape) - 1, 1, -1):
        strides[d] = step
        step *= shape[d]
    strides[0] = step
    return tuple(strides)


def _dense_channels_last(t: torch.Tensor) -> bool:
    """Whether ``t`` is dense with its channels innermost (sizes-1 dimensions' strides aside; an
    empty tensor is)."""
    expected = channels_last_strides_of(t.shape)
    return not t.numel() or all(n == 1 or s == e for n, s, e in zip(t.shape, t.stride(), expected))


def in_layout(t: torch.Tensor, last: bool) -> torch.Tensor:
    """``t`` in the contiguous or channels-last layout (a copy only when it is in another)."""
    if last == channels_last(t) and (_dense_channels_last(t) if last else t.is_contiguous()):
        return t
    if not last:
        return t.contiguous()
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def output_size(size: int, kernel: int, stride: int, pre: int, post: int, dilation: int) -> int:
    return (size + pre + post - dilation * (kernel - 1) - 1) // stride + 1


# ``ConvProblem.prologue`` bits: x * scale[c], + shift[c], then ReLU (in that order).
PROLOGUE_SCALE, PROLOGUE_SHIFT, PROLOGUE_RELU = 1, 2, 4


@dataclasses.dataclass(frozen=True)
class ConvProblem(Problem):
    """One convolution, in the terms of the forward convolution ``y = conv(x, w)``.

    The three directions share it: ``fwd`` computes y, ``dgrad`` x's gradient from y's, ``wgrad``
    w's gradient. ``x_strides``, ``w_strides``, ``y_strides`` are the 5-D strides of x, w and y
    (whichever of them the direction reads or writes). ``dtype`` is the operands', ``out_dtype``
    the written tensor's. Epilogue (``fwd`` and ``dgrad``, where the written tensor is y or x):
    ``bias``, ``has_c``, ``residual`` (tensors laid out as the output), ``activation`` (an
    ``Activation`` value or -1), ``store_pre``. ``tf32``: fp32 products may use TF32.
    ``prologue`` (``fwd``, the implicit GEMM only): what is applied to x per input channel as it
    is read, a bit mask of ``PROLOGUE_SCALE``, ``PROLOGUE_SHIFT``, ``PROLOGUE_RELU`` (cuDNN's
    scale-bias-relu before a convolution); 0 for none.
    """

    direction: str
    nd: int
    n: int
    cin: int
    cout: int
    groups: int
    in_size: Triple
    out_size: Triple
    kernel: Triple
    stride: Triple
    pad: Triple
    dilation: Triple
    x_strides: Strides5
    w_strides: Strides5
    y_strides: Strides5
    dtype: str
    out_dtype: str
    bias: bool = False
    has_c: bool = False
    residual: bool = False
    activation: int = -1
    store_pre: bool = False
    tf32: bool = False
    deterministic: bool = False
    prologue: int = 0

    def key(self) -> str:
        """``Problem.key`` without ``prologue=0``: the autotune cache's keys from before the field."""
        text = super().key()
        return text.replace(",prologue=0)", ")") if not self.prologue else text

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    @property
    def cin_g(self) -> int:
        return self.cin // self.groups

    @property
    def cout_g(self) -> int:
        return self.cout // self.groups

    @property
    def out_pixels(self) -> int:
        return self.n * math.prod(self.out_size)

    @property
    def in_pixels(self) -> int:
        return self.n * math.prod(self.in_size)

    @property
    def flops(self) -> int:
        """Multiply-adds times 2 of the direct algorithm (the same for every direction)."""
        return 2 * self.out_pixels * self.cout * self.cin_g * self.taps

    @property
    def bytes(self) -> int:
        """x, w and y, each moved once."""
        size = itemsize(self.dtype)
        return size * (
            self.in_pixels * self.cin + self.cout * self.cin_g * self.taps + self.out_pixels * self.cout
        )

    @property
    def channels_last(self) -> bool:
        """Whether the activations keep channels innermost (x's channel stride is 1)."""
        return self.x_strides[1] == 1 and self.cin > 1

    @property
    def depthwise(self) -> bool:
        return self.groups == self.cin and self.cout % self.cin == 0

    @property
    def index_64(self) -> bool:
        """Offsets may reach 2**31 - 16 (``engines.row_limit``): every tensor's span is checked."""
        spans = [
            sum((s - 1) * abs(st) for s, st in zip((self.n, self.cin, *self.in_size), self.x_strides)),
            sum((s - 1) * abs(st) for s, st in zip((self.n, self.cout, *self.out_size), self.y_strides)),
            sum((s - 1) * abs(st) for s, st in zip((self.cout, self.cin_g, *self.kernel), self.w_strides)),
        ]
        return max(*spans, self.out_pixels * self.cout, self.in_pixels * self.cin) >= 2**31 - 16
