"""Matmul problems and the four engines: ``tiled`` (any GPU, any layout), ``tma-persistent``
(Hopper, tensor descriptors), ``split-k`` (few output tiles, long K) and ``skinny`` (M <= 64).

A call reaches this module with operands of rank >= 2 whose batch dimensions merge into at most two
(the public layer in ``__init__`` guarantees it), ``c`` and ``residual`` of the output's full shape
(any strides, 0 for broadcast), and a 1-D bias. ``layout`` turns that into a ``MatmulProblem``:
sizes, every tensor's strides over (batch outer, batch inner, rows, cols), dtypes and epilogue
flags. Problems with few columns and many rows are solved transposed (out.T = B.T @ A.T), which
makes them skinny-M problems: a matrix-vector product becomes a GEMV over the matrix's rows.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Callable

import torch
import triton.language as tl

from ...core.arrival import arrival_counters
from ...core.backend import INTERPRET, hopper, sm_count
from ...core.config import config
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import Described, cdiv, launcher
from ...core.strides import broadcast_shapes, collapse, empty_aligned_rows
from ..transform import transform_tensor
from .kernels import _reduce_kernel, _split_kernel, _tf32_planes_kernel, _tiled_kernel
from .tma import _persistent_kernel, _stream_k_kernel, _stream_k_sums_kernel

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, *FP8_DTYPES)
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
Strides = tuple[int, int, int, int]  # (batch outer, batch inner, row, col)
SKINNY_M = 64  # the most rows the skinny engine takes in one tile


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def preactivation_dtype(input_dtype: torch.dtype, out_dtype: torch.dtype) -> torch.dtype:
    """The stored pre-activation's dtype: the wider of the operands' and the output's (the output's
    for fp8), so a narrower output does not cost the backward pass precision."""
    return out_dtype if input_dtype in FP8_DTYPES else torch.promote_types(input_dtype, out_dtype)


@dataclasses.dataclass(frozen=True)
class MatmulProblem(Problem):
    """One launch of ``out = epilogue(A @ B)`` over ``batch`` matrices of M x N, reduction K.

    The batch is two merged dimensions (``batch`` in all, ``batch_inner`` the inner one's size);
    strides are ``Strides`` per tensor. ``dtypes``: A, B, out. ``c_strides``/``residual_strides``
    are None when that input is absent; ``bias``: 0 none, 1 per column, 2 per row;
    ``activation``: an ``Activation`` value or -1. ``scaled``: fp8 with per-tensor scales.
    ``tf32``: fp32 products run on the TF32 tensor cores: one TF32 product each where
    ``config.allow_tf32``, three where ``tf32x3`` (each operand split into a TF32 head and tail,
    the tail x tail term dropped: about fp32's accuracy; the recurrent networks' products ask for
    it, as their recurrence runs so; the persistent kernel reads the operands split beforehand,
    ``tf32_planes``). ``fast_accum``: fp8 products
    accumulate in the tensor cores' own precision over the whole K loop.
    """

    m: int
    n: int
    k: int
    batch: int
    batch_inner: int
    dtypes: tuple[str, str, str]
    a_strides: Strides
    b_strides: Strides
    out_strides: Strides
    c_strides: Strides | None
    residual_strides: Strides | None
    bias: int
    bias_stride: int
    activation: int
    store_pre: bool
    scaled: bool
    amax: bool
    tf32: bool
    index_64: bool
    fast_accum: bool = False
    tf32x3: bool = False

    @property
    def fp8(self) -> bool:
        return self.dtypes[0].startswith("float8")

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    @property
    def bytes(self) -> int:
        """Bytes of A, B and the output, each moved once."""
        a, b, out = (_ITEMSIZE[d] for d in self.dtypes)
        return self.batch * (self.m * self.k * a + self.k * self.n * b + self.m * self.n * out)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A problem and what a plan needs to run it on tensors: the output's shape (contiguous) and
    whether the problem is the transposed one (then A and B trade places in the launch)."""

    problem: MatmulProblem
    out_shape: tuple[int, ...]
    swapped: bool


def _broadcast_strides(
    shape: tuple[int, ...], strides: tuple[int, ...], target: tuple[int, ...]
) -> list[int]:
    """Strides of ``shape`` expanded to ``target`` (leading and size-1 dimensions get stride 0)."""
    pad = len(target) - len(shape)
    return [0 if i < pad or shape[i - pad] != target[i] else strides[i - pad] for i in range(len(target))]


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _strides(a, b, c, residual) -> tuple[tuple[int, ...], dict[str, list[int]]]:
    """The batch shape, and the strides of out (contiguous), a, b, c and residual over their
    broadcast shapes (batch..., rows, cols)."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch_shape = tuple(broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    out_shape = (*batch_shape, m, n)
    tensors = {
        "out": _contiguous_strides(out_shape),
        "a": _broadcast_strides(tuple(a.shape), a.stride(), (*batch_shape, m, k)),
        "b": _broadcast_strides(tuple(b.shape), b.stride(), (*batch_shape, k, n)),
    }
    for name, t in (("c", c), ("residual", residual)):
        if t is not None:
            tensors[name] = _broadcast_strides(tuple(t.shape), t.stride(), out_shape)
    return batch_shape, tensors


def merged_batch_dims(a, b, c, residual) -> int:
    """How many dimensions the call's batch merges into (``layout`` takes at most two)."""
    batch_shape, tensors = _strides(a, b, c, residual)
    return len(collapse(batch_shape, *(s[: len(batch_shape)] for s in tensors.values()))[0])


def layout(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    *,
    out_dtype: torch.dtype,
    bias_kind: int,
    activation: int,
    store_pre: bool,
    scaled: bool,
    amax: bool,
    fast_accum: bool = False,
    tf32x3: bool = False,
) -> Layout:
    """The problem the call poses (see the module docstring for what the tensors must be);
    ``tf32x3``: fp32 products as three TF32 products where TF32 is not allowed."""
    m, k = a.shape[-2:]
    n = b.shape[-1]
    batch_shape, tensors = _strides(a, b, c, residual)
    out_shape = (*batch_shape, m, n)
    nb = len(batch_shape)
    sizes, batch_strides = collapse(batch_shape, *(s[:nb] for s in tensors.values()))
    if len(sizes) > 2:
        raise ValueError(f"tdnn.matmul: batch dimensions {batch_shape} do not merge into two; copy first")
    if len(sizes) == 1:
        sizes, batch_strides = [1, *sizes], [[0, *s] for s in batch_strides]
    full = {
        name: (*bs, *s[nb:]) for (name, s), bs in zip(tensors.items(), batch_strides)
    }  # (outer, inner, row, col) for each tensor
    reach = max(
        sum((size - 1) * abs(st) for size, st in zip((*sizes, rows, cols), s))
        for s, rows, cols in (
            (full["out"], m, n),
            (full["a"], m, k),
            (full["b"], k, n),
            *((full[x], m, n) for x in ("c", "residual") if x in full),
        )
    )
    swapped = n <= SKINNY_M < m
    if swapped:  # out.T = B.T @ A.T: rows and columns trade places in every tensor
        t = lambda s: (s[0], s[1], s[3], s[2])
        full = {name: t(s) for name, s in full.items()}
        full["a"], full["b"] = full["b"], full["a"]
        m, n = n, m
        bias_kind = {0: 0, 1: 2, 2: 1}[bias_kind]
    dt_a, dt_b = (b.dtype, a.dtype) if swapped else (a.dtype, b.dtype)
    problem = MatmulProblem(
        m=m,
        n=n,
        k=k,
        batch=sizes[0] * sizes[1],
        batch_inner=sizes[1],
        dtypes=(dtype_name(dt_a), dtype_name(dt_b), dtype_name(out_dtype)),
        a_strides=full["a"],
        b_strides=full["b"],
        out_strides=full["out"],
        c_strides=full.get("c"),
        residual_strides=full.get("residual"),
        bias=bias_kind,
        bias_stride=bias.stride(0) if bias is not None else 0,
        activation=activation,
        store_pre=store_pre,
        scaled=scaled,
        amax=amax,
        tf32=(config.allow_tf32 or tf32x3) and a.dtype == torch.float32,
        index_64=max(reach + 1, math.prod(out_shape)) > 2**31 - 1,
        fast_accum=fast_accum,
        tf32x3=tf32x3 and not config.allow_tf32 and a.dtype == torch.float32,
    )
    return Layout(problem, out_shape, swapped)


def _describe(input: torch.Tensor, other: torch.Tensor) -> MatmulProblem:
    """The problem ``tdnn.matmul(input, other)`` poses, for ``tdnn.engines("matmul", a, b)``."""
    a = input.unsqueeze(0) if input.ndim == 1 else input
    b = other.unsqueeze(-1) if other.ndim == 1 else other
    out_dtype = torch.bfloat16 if a.dtype in FP8_DTYPES else a.dtype
    scaled = a.dtype in FP8_DTYPES
    return layout(
        a, b, None, None, None, out_dtype=out_dtype, bias_kind=0, activation=-1, store_pre=False,
        scaled=scaled, amax=False,
    ).problem  # fmt: skip


FAMILY: Family[MatmulProblem] = Family("matmul", _describe)


# ---------------------------------------------------------------------------------------------
# Engines. Each bind returns ``run(a, b, out, c, bias, residual, pre, scale_a, scale_b, amax,
# alpha, beta, p0, p1)`` (absent tensors replaced by ``out``), launching on the problem's layout.


# Dense rates in TFLOP/s a good kernel reaches on H100 (fp32 without TF32 runs on the CUDA cores),
# and memory bandwidth in TB/s: the cost model's units are microseconds.
_PEAK = {
    "float16": 700,
    "bfloat16": 700,
    "float8_e4m3fn": 1300,
    "float8_e5m2": 1300,
    "float32": 50,
    "float64": 50,
}
_TF32_PEAK = 350
_BANDWIDTH = 3.0


def _peak(p: MatmulProblem) -> float:
    return (_TF32_PEAK / 3 if p.tf32x3 else _TF32_PEAK) if p.tf32 else _PEAK[p.dtypes[0]]


def _roofline(p: MatmulProblem, compute_eff: float, bandwidth_eff: float, extra_bytes: int = 0) -> float:
    """Microseconds: the slower of the arithmetic and the memory traffic at the given efficiencies."""
    return max(
        p.flops / (_peak(p) * 1e6 * compute_eff), (p.bytes + extra_bytes) / (_BANDWIDTH * 1e6 * bandwidth_eff)
    )


def _wave_util(programs: int, per_sm: int = 1) -> float:
    """Fraction of the SMs busy over the waves ``programs`` equal programs take, ``per_sm`` of them
    an SM a wave."""
    slots = per_sm * sm_count()
    return programs / (cdiv(programs, slots) * slots) if programs else 1.0


def _wave_util_of(p: MatmulProblem, programs: int) -> float:
    """``_wave_util``, for fp32 without TF32 (the FMA units) with two programs an SM a wave: one
    program an SM hides too little latency and runs at about half the rate, two share it. H100,
    fp32: 2048x512 over K=16384 in 128 64x128 tiles 1367 us (25 TFLOP/s), split in two over 512
    64x64 programs 786 (44); 4096x1024x4096 in 256 128x128 tiles 765 (45), 4096^3 in 1024 2878
    (48)."""
    return _wave_util(programs, 2 if p.dtypes[0] == "float32" and not p.tf32 else 1)


def _epilogue_constexprs(p: MatmulProblem) -> tuple:
    return (p.c_strides is not None, p.bias, p.activation, p.residual_strides is not None,
            p.store_pre, p.scaled, p.amax)  # fmt: skip


def _epilogue_strides(p: MatmulProblem) -> tuple[int, ...]:
    return (*(p.c_strides or (0,) * 4), *(p.residual_strides or (0,) * 4), p.bias_stride)


def _dot_constexprs(p: MatmulProblem) -> tuple:
    """ACC, PRECISION, UPCAST."""
    acc = tl.float64 if p.dtypes[0] == "float64" else tl.float32
    # "tf32", "tf32x3" and "ieee" for fp32 operands (tl.dot's input_precision); "fast" for fp8 is
    # ``dot``'s.
    precision = ("tf32x3" if p.tf32x3 else "tf32") if p.tf32 else "fast" if p.fast_accum else "ieee"
    return acc, precision, INTERPRET and p.dtypes[0] == "bfloat16"


def _interpreter_reasons(p: MatmulProblem) -> list[str]:
    if INTERPRET and p.fp8:
        return ["Triton's interpreter has no fp8 arithmetic"]
    return []


def _fits(bm: int, bn: int, bk: int, warps: int, stages: int, itemsize: int) -> bool:
    """Whether the pipeline's A and B tiles fit in shared memory (227 KB on H100; some is left for
    the epilogue's layout conversions)."""
    return stages * (bm * bk + bk * bn) * itemsize <= 200 * 1024


def _tile(bm: int, bn: int, bk: int, warps: int, stages: int, group: int = 8) -> LaunchConfig:
    return {
        "BLOCK_M": bm,
        "BLOCK_N": bn,
        "BLOCK_K": bk,
        "GROUP_M": group,
        "num_warps": warps,
        "num_stages": stages,
    }


def _tile_configs(p: MatmulProblem) -> list[LaunchConfig]:
    """Tile shapes for the tiled and persistent kernels, the heuristic's pick first: 128x256
    (16-bit) or 256x128x128 (fp8) tiles for big problems, smaller ones where the big tiles would
    leave SMs idle."""
    if p.fp8:
        # 256x128 before 128x256: 1001-1060 us against 1150-1200 (H100, 8192^3 e4m3, GROUP_M 16).
        shapes = [(256, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (64, 128, 128, 4, 4)]
    elif p.dtypes[0] == "float64":
        shapes = [(64, 64, 16, 4, 2), (32, 32, 16, 4, 2), (64, 32, 32, 4, 2)]
    elif p.dtypes[0] == "float32" and not p.tf32:
        shapes = [(128, 128, 32, 8, 3), (64, 128, 32, 4, 3), (128, 64, 32, 4, 3), (64, 64, 32, 4, 4)]
    elif p.tf32x3:
        # The persistent kernel loads four tiles a K step (``_planes_bytes``). H200, TF32 planes
        # (``scratch/planes_x3.py``): 128x128x32 (8 warps, 3 stages) led at 16384x2048x512,
        # 16384x512x2048, 4096^2x1024, 4096^3 (99-107 TFLOP/s); 64x128x32 (4 warps, 4 stages) at
        # 2048x512x16384 (92), where 128x128 tiles fill half the SMs.
        shapes = [(128, 128, 32, 8, 3), (64, 128, 32, 4, 4), (64, 64, 32, 4, 4)]
    elif p.dtypes[0] == "float32":  # TF32: fp32 tiles take twice the shared memory of fp16 ones
        shapes = [
            (128, 256, 32, 8, 3),
            (128, 128, 32, 4, 4),
            (128, 128, 32, 8, 3),
            (64, 128, 32, 4, 4),
            (64, 64, 32, 4, 4),
        ]
    else:
        shapes = [
            (128, 256, 64, 8, 3),
            (128, 128, 64, 4, 4),
            (128, 128, 64, 8, 4),
            (64, 128, 64, 4, 4),
            (256, 128, 64, 8, 3),
            (64, 64, 64, 4, 4),
        ]
    configs = [_tile(*s, group=16 if p.fp8 else 8) for s in shapes if _fits(*s, _planes_bytes(p))]
    big = configs[0]
    if _tiles(p, big) < sm_count():
        if _long_k(p):
            configs.sort(key=lambda c: _long_k_time(p, c))
        else:
            configs.sort(key=lambda c: -_wave_util(_tiles(p, c)))
    elif p.dtypes[0] in ("float16", "bfloat16") and 1024 < p.k <= 4096 and _wave_util(_tiles(p, big)) < 0.8:
        # A last wave of big tiles mostly empty: 128x128 tiles (4 warps) fill theirs. Measured on
        # H100 (bf16, K-major A; us, 128x256 -> 128x128): 8192x768x2304 63.2 -> 54.3,
        # 8192x768x3072 79.0 -> 70.5 and 82.8 -> 70.6 (cuBLAS 44, 55, 56). A longer K lost:
        # 8192x768x50257 (GPT-2's LM head data gradient) 2.02 -> 2.33 ms.
        configs.sort(key=lambda c: (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]) != (128, 128, 4))
    return configs


def _tiles(p: MatmulProblem, c: LaunchConfig) -> int:
    """Output tiles of ``p`` in ``c``'s tile shape."""
    return cdiv(p.m, c["BLOCK_M"]) * cdiv(p.n, c["BLOCK_N"]) * p.batch


# A long reduction (weight gradients over the tokens or pixels of a batch) with too few big tiles
# to fill the SMs: each tile's time grows with K, so the tile's own rate decides more than the
# idle SMs of a wave. Rates of 16-bit tiles on one SM, TFLOP/s, measured on H100 (bf16, GPT-2
# small's weight gradients, K = 8192 tokens, A = dy^T M-major; us, kernels bound directly):
# 3072x768 128x256 85 (one wave), 64x64 175, cuBLAS 57; 768x3072 87 against 185; 2304x768 128x128
# 56, 128x256 85; 768x768 64x128 47.4.
LONG_K = 4096
_LONG_K_SM_RATE = 6.3  # TFLOP/s of a 128x256 tile on one SM, the others a share of it
_TILE_RATE = {(128, 256): 1.0, (256, 128): 0.95, (128, 128): 0.76, (64, 128): 0.45, (64, 64): 0.3}


def _long_k(p: MatmulProblem) -> bool:
    """A 16-bit reduction of LONG_K or more whose 128x256 tiles do not fill the SMs."""
    return (
        p.k >= LONG_K
        and p.dtypes[0] in ("float16", "bfloat16")
        and cdiv(p.m, 128) * cdiv(p.n, 256) * p.batch < sm_count()
    )


def _long_k_us(bm: int, bn: int, k: int, waves: float) -> float:
    """Microseconds of ``waves`` rounds of bm x bn tiles reducing over ``k``, at the tile's rate."""
    return waves * 2 * bm * bn * k / (_LONG_K_SM_RATE * 1e6 * _TILE_RATE.get((bm, bn), 0.3))


def _long_k_time(p: MatmulProblem, c: LaunchConfig) -> float:
    """Microseconds of ``p`` in ``c``'s tiles, one per SM at a time (whole waves)."""
    return _long_k_us(c["BLOCK_M"], c["BLOCK_N"], p.k, cdiv(_tiles(p, c), sm_count()))


def _ints(p: MatmulProblem) -> tuple[int, ...]:
    return (*p.a_strides, *p.b_strides, *p.out_strides, *_epilogue_strides(p))


@FAMILY.register
class TiledEngine(Engine[MatmulProblem]):
    """Any problem: output tiles in grouped order, operands read in place through their strides."""

    name = "tiled"

    def not_supported_reasons(self, problem: MatmulProblem) -> list[str]:
        return _interpreter_reasons(problem)

    def cost(self, problem: MatmulProblem) -> float:
        c = self.configs(problem)[0]
        if _long_k(problem):  # measured as fast as the persistent kernel's tiles there, or faster
            return _long_k_time(problem, c) / _in_place_rate(problem) + 4
        programs = _tiles(problem, c)
        compute = 0.8 * _wave_util_of(problem, programs) * _in_place_rate(problem)
        return _roofline(problem, compute, 0.6 * min(1.0, programs / sm_count())) + 4

    def configs(self, problem: MatmulProblem) -> list[LaunchConfig]:
        return _tile_configs(problem)

    def bind(self, problem: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        repack_a, repack_b = _fma_repacks(p)
        if repack_a:
            p = dataclasses.replace(p, a_strides=(0, 0, 1, p.m))
        if repack_b:
            p = dataclasses.replace(p, b_strides=(0, 0, p.n, 1))
        bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
        launch = launcher(
            _tiled_kernel,
            (cdiv(p.m, bm) * cdiv(p.n, bn) * p.batch,),
            num_tensors=10,
            ints=(p.m, p.n, p.k, p.batch_inner, *_ints(p)),
            constexprs=(
                *_epilogue_constexprs(p),
                *_dot_constexprs(p),
                p.index_64,
                p.k % bk == 0,
                bm,
                bn,
                bk,
                config["GROUP_M"],
            ),
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
        if not (repack_a or repack_b):
            return launch

        def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *rest: object) -> None:
            if repack_a:
                a = _row_major(a.as_strided((problem.m, problem.k), problem.a_strides[2:]).t()).t()
            if repack_b:
                b = _row_major(b.as_strided((problem.k, problem.n), problem.b_strides[2:]))
            launch(a, b, out, *rest)

        return run


FMA_REPACK_MIN = 2**30  # multiply-adds from which fp32 operands are copied to the FMA kernel's layouts


def _fma_repacks(p: MatmulProblem) -> tuple[bool, bool]:
    """Whether the tiled kernel copies a row-major A column-major and a K-major B row-major first,
    for fp32 without TF32: its FMA products run fastest on A stored M-major and B N-major. H100,
    4096^3 with A already M-major: 2.82 ms against 3.16 with A row-major and 6.17 with B K-major;
    each copy moves 128 MB in about 50 us (end to end, every layout: 0.93-0.97x cuBLAS). Small
    products keep their layouts: a copy's launch would cost more than it saves."""
    if p.dtypes[0] != "float32" or p.tf32 or p.batch != 1 or p.m * p.n * p.k < FMA_REPACK_MIN:
        return False, False
    return p.a_strides[2:] == (p.k, 1) and p.m > 1 and p.k > 1, p.b_strides[2:] == (1, p.k) and p.n > 1


def _aligned(stride: int, itemsize: int) -> bool:
    return (stride * itemsize) % 16 == 0


def _tma_transposed(strides: Strides, dtype: str) -> bool | None:
    """How a descriptor reads a matrix with these (.., .., row, col) strides: False when rows are
    contiguous runs (col stride 1), True when columns are, None when neither is aligned."""
    rows, cols = strides[2:]
    size = _ITEMSIZE[dtype]
    if cols == 1 and _aligned(rows, size):
        return False
    if rows == 1 and _aligned(cols, size):
        return True
    return None


@FAMILY.register
class PersistentTmaEngine(Engine[MatmulProblem]):
    """Hopper: one program per SM over the tiles, operands loaded by tensor descriptors (TMA)."""

    name = "tma-persistent"

    def not_supported_reasons(self, problem: MatmulProblem) -> list[str]:
        p = problem
        if INTERPRET:
            return ["needs a Hopper GPU (tensor descriptors); the interpreter runs the tiled kernels"]
        reasons = []
        if not hopper():
            reasons.append("needs compute capability 9.0 or newer for tensor descriptors (TMA)")
        if p.batch != 1:
            reasons.append(f"one matrix only; this problem has a batch of {p.batch}")
        if p.k == 0:
            reasons.append("K is 0")
        if p.dtypes[0] == "float32" and not p.tf32:
            reasons.append(
                "fp32 without TF32: its ieee dots on descriptor-loaded tiles ran at 0.7 TFLOP/s (H100, "
                "4096x4096x1024 with B transposed); the tiled kernel takes fp32"
            )
        return reasons

    def cost(self, problem: MatmulProblem) -> float:
        c = _tile_configs(problem)[0]  # the model's tile (the first config may be a measured exception)
        tiles = cdiv(problem.m, c["BLOCK_M"]) * cdiv(problem.n, c["BLOCK_N"])
        repack_a, repack_b = _repacks(problem)
        copied = (1 + _planes_bytes(problem) // _ITEMSIZE[problem.dtypes[0]]) * (  # read + write
            bool(repack_a) * _ITEMSIZE[problem.dtypes[0]] * problem.m * problem.k
            + bool(repack_b) * _ITEMSIZE[problem.dtypes[1]] * problem.k * problem.n
        )
        split = _tma_split(problem)
        if _stream_k_fits(problem):  # the tiles' rate over the SMs, plus the partial tiles' sums
            kernel = _long_k_us(128, 128, problem.k, _tiles(problem, _STREAM_K) / sm_count()) + 8
        elif split > 1:  # a wave of tiles over a chunk of K, then the sum (partials read, out written)
            sums = (split + 1) * 4 * problem.m * problem.n / (_BANDWIDTH * 1e6)
            kernel = _long_k_us(128, 128, cdiv(problem.k, split), 1.0) + sums + 4
        elif _long_k(problem):  # a wave or two of long tiles: their rate, not the idle SMs, decides
            kernel = _long_k_time(problem, c)
        else:
            kernel = _roofline(problem, 0.9 * _wave_util(tiles), 0.65 * min(1.0, tiles / sm_count()))
        return kernel + 5 + copied / (_BANDWIDTH * 1e6 * 0.9)

    def configs(self, problem: MatmulProblem) -> list[LaunchConfig]:
        # A descriptor store stages the output tile in shared memory beside the pipeline's
        # buffers; where both do not fit (TF32 128x256x32 tiles failed to build), the tile is
        # stored from registers instead, and a 32-bit output of 16-bit operands in column halves.
        # H100: TF32 4096^3 (B K-major) with 128x256x32 tiles so stored 398 us, where the
        # 128x128x32 tiles taken before ran 436; bf16 into fp32 with 128x256x64 tiles 200 us at
        # 4096^3 (halves 202) against 226 before, 1660 us at 8192^3 (1804 without halves, 1790 before).
        out_bytes = _ITEMSIZE[problem.dtypes[2]]
        halves = out_bytes > _ITEMSIZE[problem.dtypes[0]]
        tiles = [
            c
            if c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * _planes_bytes(problem)
            + c["BLOCK_M"] * c["BLOCK_N"] * out_bytes
            <= 216 * 1024
            else {**c, "STORE_DESC": False, "SUBTILE": halves}
            for c in _tile_configs(problem)
        ]
        plain = [{**c, "FLATTEN": False} for c in tiles]
        if not (problem.fp8 or problem.dtypes[0] in ("float16", "bfloat16")):
            return plain
        ordered = self._ordered(problem, tiles, plain)
        if _stream_k_fits(problem):
            # The split tiles summed by a second kernel: a candidate for ``config.benchmark`` (its
            # time against the last arrivals' not measured yet).
            return [_STREAM_K, {**_STREAM_K, "SUMS_AFTER": True}, *ordered]
        split = _tma_split(problem)
        if split > 1:
            lead = {**_tile(128, 128, 64, 4, 4), "FLATTEN": False, "SPLIT": split}
        else:
            lead = _flattened_lead(problem) or _medium_lead(problem)
        return ordered if lead is None else [lead, *(c for c in ordered if c != lead)]

    @staticmethod
    def _ordered(
        problem: MatmulProblem, tiles: list[LaunchConfig], plain: list[LaunchConfig]
    ) -> list[LaunchConfig]:
        """16-bit and fp8 configs, best first, for problems with many big tiles."""
        big = [c for c in tiles if c["BLOCK_M"] >= 128 and c["BLOCK_N"] >= 128][:2]
        # One loop over (tile, K step): the next tile's loads start during this tile's epilogue.
        flattened = [{**c, "FLATTEN": True} for c in big[:1]]
        if problem.fp8 or not big or big[0] != tiles[0] or problem.k > 1024:
            # (For 1024 < K <= 4096 with an activation, flattened loops over the tile's column
            # halves had led, asked to be warp-specialized (which Triton 3.6 does not do on sm_90,
            # see ``_flattened_lead``): bias + gelu at 8192 x 11008, K = 4096, 1154 -> 1125 us on an
            # H100. Plain tiles lead there now.)
            return plain + flattened
        # The first pick, measured on H100 (bf16, 128x256 tiles): flattening gained 10% at K = 512.
        p = problem
        heavy = p.activation >= 0 or p.residual_strides is not None
        if heavy and cdiv(p.m, 128) * cdiv(p.n, 128) >= 4 * sm_count():
            # A short K loop leaves the epilogue a large share of the time: two 128x128 programs
            # per SM overlap one's epilogue with the other's MMAs. Measured on H100 (8192 x 4096,
            # K = 1024, bf16): bias + gelu 162.8 -> 143.9 us, residual 143.2 -> 131.4 us,
            # bias + silu even (124.4 / 125.7 us); bias alone 108.9 -> 112.8 us, so not there.
            # An activation's epilogue runs over column halves: GELU-tanh storing its
            # pre-activation (GPT-2 small's first MLP layer, 8192 x 3072, K = 768, bf16) took
            # 170.9 us whole, 109.9 in halves on an H200 (with tanh's exact form; ptxas spilled
            # 2.6 KB a thread whole, 36 bytes in halves; with the sigmoid form 220 and none).
            halves = {**_PAIRED, "SUBTILE": True}
            paired = [halves, _PAIRED] if p.activation >= 0 else [_PAIRED, halves]
            return [*paired, *flattened, *plain]
        return flattened + plain

    def bind(self, problem: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        # What runs if this config fails to build: the same tile without flattening (its pipeline
        # takes more shared memory: a residual epilogue overflowed it with 128x256 tiles), then the
        # tiled kernel.
        tiled = TiledEngine().bind(p, _tile_configs(p)[0])
        plain = {**config, "FLATTEN": False}
        plain.pop("STREAM_K", None)  # a stream-K config falls back to the persistent kernel
        configs = [config] + ([plain] if plain != config else [])
        repack_a, repack_b = _repacks(p)
        copy_a = copy_b = None
        if repack_a:
            copy_a = _copier(p.m, p.k, p.a_strides[2:], repack_a)
            p = dataclasses.replace(p, a_strides=(0, 0, *_repacked_strides(p.m, p.k, repack_a, p.dtypes[0])))
        if repack_b:  # B^T (N x K) is copied
            copy_b = _copier(p.n, p.k, (p.b_strides[3], p.b_strides[2]), repack_b)
            n_stride, k_stride = _repacked_strides(p.n, p.k, repack_b, p.dtypes[1])
            p = dataclasses.replace(p, b_strides=(0, 0, k_stride, n_stride))

        def bound(c: LaunchConfig) -> Callable[..., None]:
            if c.get("STREAM_K"):
                return _stream_k_launch(p, c)
            return (_split_tma_launch if c.get("SPLIT", 1) > 1 else _persistent_launch)(p, c)

        attempts = [(f"the {self.name} kernel with {c}", bound(c)) for c in configs]
        attempts.append(("the tiled kernel", tiled))
        launch = None

        def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *rest: object) -> None:
            nonlocal launch
            # Descriptors need 16-byte-aligned base addresses, which only the call knows (copies
            # are made aligned). The tiled kernel reads the operands as given, never the copies.
            if launch is tiled or (
                ((0 if repack_a else a.data_ptr()) | (0 if repack_b else b.data_ptr()) | out.data_ptr()) & 15
            ):
                tiled(a, b, out, *rest)
                return
            a_in, b_in = a, b
            if copy_a is not None:
                a_in = copy_a(a.as_strided((problem.m, problem.k), problem.a_strides[2:]))
            if copy_b is not None:
                b_in = copy_b(b.as_strided((problem.k, problem.n), problem.b_strides[2:]).t()).t()
            if launch is not None:
                launch(a_in, b_in, out, *rest)
                return
            for (name, attempt), (then, _) in itertools.pairwise(attempts):
                try:  # the first launch compiles
                    attempt(a_in, b_in, out, *rest)
                except Exception as exc:  # Triton's passes raise errors of many kinds
                    warnings.warn(
                        f"tritondnn: {name} failed to build ({type(exc).__name__}: {str(exc)[:200]}); "
                        f"using {then} instead",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    continue
                launch = attempt
                return
            launch = tiled
            tiled(a, b, out, *rest)

        return run


# Two 128x128 programs per SM, the loops flattened, the output stored through pointers (a
# descriptor store's staging would not fit twice).
_PAIRED = {
    **_tile(128, 128, 64, 4, 3),
    "FLATTEN": True,
    "CTAS": 2,
    "STORE_DESC": False,
}


def _medium_lead(p: MatmulProblem) -> LaunchConfig | None:
    """The paired config (two 128x128 programs per SM) where it goes first for a 16-bit problem:
    K of at most 1024 and either 128x256 tiles that would leave SMs idle in their last wave or a
    K of at most 256 (then the epilogue takes a large share). Measured on H100 (bf16, ResNet-50's
    1x1 convolutions as GEMMs; us, the pick before -> paired): 50176x512x128 53.2 (split-K) ->
    30.7, 200704x256x64 55.5 -> 52.4, 12544x256x1024 31.6 (64x128 tiles) -> 24.4, 3136x2048x1024
    32.8 -> 30.8, 12544x1024x256 24.8 -> 23.3. (A longer K was not measured better: a weight
    gradient's K = 3136 ran 56.7 us in 128x128 tiles against 24.4 split over K.)

    Up to K = 2048, a K-major A whose 128x128 tiles all fit in one wave takes them one program per
    SM: 3136x512x2048 ran 22.5 us so, against 37.2 in the 64x64 tiles the wave count picked (and
    26.0 paired). (With an M-major A, as in a weight gradient, 128x128 tiles lost: 2048x1024x3136
    98.6 us against 39.5.)
    """
    if p.fp8 or p.dtypes[0] not in ("float16", "bfloat16") or p.batch != 1 or p.k > 2048:
        return None
    few = _wave_util(cdiv(p.m, 128) * cdiv(p.n, 256)) < 0.85
    square = cdiv(p.m, 128) * cdiv(p.n, 128)
    if p.k <= 1024 and square >= sm_count() and (few or p.k <= 256):
        return _PAIRED
    if few and square < sm_count() and p.k > 1024 and p.a_strides[3] == 1:
        return {**_tile(128, 128, 64, 4, 4), "FLATTEN": False}
    return None


def _flattened_lead(p: MatmulProblem) -> LaunchConfig | None:
    """The flattened config (one loop over tiles and K steps; the epilogue over column halves)
    where it leads: a 16-bit product of 512 <= K <= 4096 with a K-major A over at least a wave of
    128x128 tiles; 128x256 tiles (8 warps) where they keep their waves 90% busy, else 128x128 (4
    warps; 5 stages for K > 1024 or four waves of tiles or more, else 4).

    H200, one run each (us; 128x256 3 stages / 128x128 at 4, 5, 6 stages; cuBLAS):
    8192x2304x768 (128x256 waves 87% busy) 50.1 / 48.8, 47.5, 47.3 (45.3); 8192x768x768 (384
    128x128 tiles) - / 17.3, 17.5, 17.7 (15.9), its data gradient 17.6, 17.9, 18.2 (16.4);
    8192x768x2304 44.1, 42.4, 42.6 (40.6); 8192x3072x768 59.3 / 62.5, 61.9, 61.8 (57.8).

    It had been asked to be warp-specialized too (``tl.range(warp_specialize=True)``), and its
    gains were put down to that; Triton 3.6 leaves the loop as it is on sm_90 (the same PTX with
    and without, 128x128 and 128x256 tiles), so what was measured is this config. Measured on an
    H200 with host-made descriptors (bf16, GPT-2 small's products, M = 8192 tokens; us, the pick
    before -> this, cuBLAS): 8192x768x768 20.3 -> 16.7 (16.0) forward and
    20.5 -> 16.7 (16.1) data gradient; 8192x768x3072 57.9 -> 53.7 (51.8); 8192x3072x768 58.7 ->
    58.1 (57.6); data gradients 8192x768x3072 58.1 -> 54.3 (51.8), 8192x3072x768 59.1 -> 58.7.
    With epilogues (the lead before -> specialized): 8192x3072x768 + bias + GELU-tanh storing its
    pre-activation 80.2 (paired tiles over column halves) -> 80.7; 8192x768x3072 + bias + residual
    61.7 (paired 71.8; the plain tiles that led before were not timed with it). Slight losses:
    ResNet-50's 3136x2048x1024 25.6 (paired) -> 26.4, 12544x256x1024 14.7 -> 14.8. (An M-major
    A, a weight gradient's, was measured at one shape only: 8192x768x3072 as fast as with a K-major
    one, 55.7 against 56.6 us; it had lost with plain 128x128 tiles, see ``_medium_lead``.)

    With device-made descriptors, an H200 training step of GPT-2 small had got NaN gradients now
    and then from these configs leading its 1024 < K <= 4096 data gradients (session 32; the
    cause was not pinned down, a host sync hid it). Descriptors are made on the host now
    (``tma._persistent_kernel``); six steps from one seed with these leads were finite and matched
    PyTorch's losses to 7.6e-6. ``tdnn.config.benchmark`` times the plain configs too.
    """
    if p.fp8 or p.dtypes[0] not in ("float16", "bfloat16") or p.batch != 1 or not 512 <= p.k <= 4096:
        return None
    if cdiv(p.m, 128) * cdiv(p.n, 128) < sm_count() or p.a_strides[3] != 1:  # a K-major A only
        return None
    if _wave_util(cdiv(p.m, 128) * cdiv(p.n, 256)) >= 0.9:
        tile = _tile(128, 256, 64, 8, 3)
    else:
        few = cdiv(p.m, 128) * cdiv(p.n, 128) < 4 * sm_count()
        tile = _tile(128, 128, 64, 4, 4 if p.k <= 1024 and few else 5)
    return {**tile, "FLATTEN": True, "SUBTILE": True}


# Stream-K in 128x128 tiles (``_stream_k_kernel``): H200, bf16, GPT-2 small's MLP weight
# gradients (768x3072 and 3072x768 over K = 8192 tokens, A = dy^T M-major; 144 such tiles on 132
# SMs): 69.4-70.3 us against 79-80 for the pick before (128x256 tiles, one wave of 72) and 53 for
# cuBLAS. Fewer tiles than SMs lost: 2304x768 (108 tiles) 55.5 against 43.8, 768x768 33.7 against
# 29.1 (split over K). Five stages (H200, one run, us; 4 stages -> 5, cuBLAS): 3072x768 into fp32
# 68.0 -> 65.1 (59.9), into bf16 65.8 -> 61.6 (53.4); 768x3072 68.5 -> 62.5 (60.6), 66.6 -> 61.2
# (53.8).
_STREAM_K = {**_tile(128, 128, 64, 4, 5), "FLATTEN": False, "STREAM_K": True}


def _stream_k_fits(p: MatmulProblem) -> bool:
    """A long 16-bit reduction (``_long_k``) whose 128x128 tiles fill the SMs once but leave the
    last wave under 90% busy: the stream-K kernel shares that wave's K loops out evenly."""
    tiles = cdiv(p.m, 128) * cdiv(p.n, 128)
    return _long_k(p) and p.batch == 1 and tiles >= sm_count() and _wave_util(tiles) < 0.9


# Split over K in 128x128 tiles (``_split_tma_launch``): H200, GPT-2 small's 768 x 768 weight
# gradient over K = 8192 tokens (A = dy^T M-major; 36 tiles split in 3 over 108 SMs): 22.0 us into
# fp32 (21.9 into bf16) against 30.5 for the pick before (the tiled split-K kernel), 29.1 stream-K
# over all 132 SMs (each partial tile's last arrival summing the others', 4 to a tile) and 21.4
# for cuBLAS; split in 2 27.0, in 4 (144 programs, two waves) 32.1, 128x256 tiles 35-47.
_SPLIT_CHUNK_STEPS = 32  # the fewest K steps (of 64) a chunk takes


def _tma_split(p: MatmulProblem) -> int:
    """How many K chunks the persistent kernel splits a long 16-bit reduction (``_long_k``) into,
    where its 128x128 tiles fill at most half the SMs: as many as keep one wave (1: no split)."""
    tiles = cdiv(p.m, 128) * cdiv(p.n, 128)
    if not _long_k(p) or p.batch != 1 or 2 * tiles > sm_count():
        return 1
    return max(1, min(sm_count() // tiles, cdiv(p.k, 64) // _SPLIT_CHUNK_STEPS))


def _tf32_repacks(p: MatmulProblem) -> tuple[bool, bool]:
    """Whether the persistent kernel copies A, B K-major first. Hopper's TF32 MMAs read both
    operands K-major from shared memory; Triton 3.6 serves an operand stored the other way by
    passing each tile through registers into a transposed shared-memory tile and waiting for the
    MMAs every K step: 76 TFLOP/s on H100 for 4096^3 with B row-major, where the copy (a tiled
    transpose at the copy rate) moves 128 MB in 38-47 us and the product then runs at 359."""
    if not p.tf32:
        return False, False
    a_m_major = _tma_transposed(p.a_strides, p.dtypes[0]) is True
    b_n_major = _tma_transposed(p.b_strides, p.dtypes[1]) is False
    return a_m_major, b_n_major


def _repacks(p: MatmulProblem) -> tuple[str | None, str | None]:
    """How the persistent kernel copies A and B (as N x K) first, if at all: ``"k-major"`` or
    ``"m-major"`` (the operand's rows or its columns contiguous), each row or column starting on
    a 16-byte boundary, or ``"planes"`` (``tf32_planes``: three TF32 products take both so).
    TF32 takes both K-major (see ``_tf32_repacks``); an operand a descriptor
    cannot read (no contiguous dimension with 16-byte-aligned rows or columns: logits over a
    vocabulary of 50257, say) is copied keeping its contiguous dimension, at the copy rate. The
    tiled kernel reading such an operand in place issues a load per element: H100, bf16 logits
    8192 x 50257 against 768 features, 6 ms for the data and for the weight gradient (105 TFLOP/s)."""
    if p.tf32x3:
        return "planes", "planes"
    out: list[str | None] = []
    b_t = (*p.b_strides[:2], p.b_strides[3], p.b_strides[2])  # B^T: N x K
    for strides, to_k_major, unaligned in zip((p.a_strides, b_t), _tf32_repacks(p), _unaligned(p)):
        if to_k_major or (p.tf32 and unaligned):
            out.append("k-major")
        elif unaligned:
            out.append("m-major" if strides[2] == 1 and strides[3] != 1 else "k-major")
        else:
            out.append(None)
    return out[0], out[1]


def _unaligned(p: MatmulProblem) -> tuple[bool, bool]:
    """Whether A and B lack a contiguous dimension with 16-byte-aligned rows or columns."""
    return (
        _tma_transposed(p.a_strides, p.dtypes[0]) is None,
        _tma_transposed(p.b_strides, p.dtypes[1]) is None,
    )


def _repacked_strides(rows: int, cols: int, how: str, dtype: str) -> tuple[int, int]:
    """(row, column) strides of ``_repack``'s copy of a rows x cols operand."""
    align = 16 // _ITEMSIZE[dtype]
    return (1, cdiv(rows, align) * align) if how == "m-major" else (cdiv(cols, align) * align, 1)


def padded_rows(x: torch.Tensor) -> torch.Tensor | None:
    """A copy of the row-major matrix ``x`` whose rows start on 16-byte boundaries, or None when
    they already do (or ``x`` is not row-major): the data and the weight gradient of a product
    share it, where each would copy an operand no descriptor reads (see ``_repacks``)."""
    if x.ndim != 2 or x.stride(1) != 1 or x.shape[0] < 2 or _aligned(x.stride(0), x.element_size()):
        return None
    return _repack(x, "k-major")


def _repack(x: torch.Tensor, how: str) -> torch.Tensor:
    """A copy of the matrix ``x`` with the strides of ``_repacked_strides`` (the padding is never read)."""
    rows, cols = x.shape
    if how == "k-major":
        if x.stride(0) == 1 and x.stride(1) != 1:
            x = _row_major(x)  # a transpose at the copy rate
            if (cols * x.element_size()) % 16 == 0:
                return x
        out = empty_aligned_rows(x, rows, cols)
    else:
        out = empty_aligned_rows(x, cols, rows).t()
    return out.copy_(x)


_Copy = Callable[[torch.Tensor], torch.Tensor]


def _copier(rows: int, cols: int, strides: tuple[int, int], how: str) -> _Copy:
    """The copy a plan makes of a rows x cols operand with these strides on every call: TF32
    planes through a launch bound here (Triton's own launcher took 34.5 us of host a launch on an
    H200 host, ``core.launcher``'s 9.6), else ``_repack``'s."""
    if how == "planes":
        return tf32_planes_split(rows, cols, strides)
    return lambda x: _repack(x, how)


def tf32_planes_split(rows: int, cols: int, strides: tuple[int, int]) -> _Copy:
    """``split(x)``: the fp32 matrix ``x`` (rows x cols, these strides) as a 2 rows x cols row-major
    matrix for three TF32 products: rows [0, rows) each value's TF32 head, the rest after
    (``_tf32_planes_kernel``), rows starting on 16-byte boundaries. One pass: the heads and tails
    read from memory by TMA spare the persistent kernel splitting tiles in registers, which ran
    Triton's "tf32x3" dots at 57-61 TFLOP/s on H200 against 92-107 so (see ``_tile_configs``)."""
    ld = _repacked_strides(rows, cols, "planes", "float32")[0]
    block = 64
    grid = (cdiv(rows, block), cdiv(cols, block))
    launch = launcher(_tf32_planes_kernel, grid, 2, (rows, cols, *strides, ld), (block, block))

    def split(x: torch.Tensor) -> torch.Tensor:
        out = empty_aligned_rows(x, 2 * rows, cols)
        launch(x, out)
        return out

    return split


def tf32_planes(x: torch.Tensor) -> torch.Tensor:
    """``tf32_planes_split`` of ``x``'s shape and strides, applied to ``x`` (one call)."""
    return tf32_planes_split(*x.shape, x.stride())(x)


def _planes_bytes(p: MatmulProblem) -> int:
    """Bytes of operand a kernel loads per element of A or B: twice the item size for TF32 planes
    (head and tail)."""
    return _ITEMSIZE[p.dtypes[0]] * (2 if p.tf32x3 else 1)


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """A row-major copy of the column-major matrix ``x``: its transpose is a contiguous C x R
    matrix, which as a (1, C, R, 1) NCHW tensor goes channels-last through the tiled transpose."""
    rows, cols = x.shape
    y = transform_tensor(x.t().reshape(1, cols, rows, 1), memory_format=torch.channels_last)
    return y[0, :, :, 0].t()


def _tma_arguments(
    p: MatmulProblem, config: LaunchConfig, programs: int, out_n: int
) -> tuple[list[Described | None], tuple, tuple]:
    """(descriptors, ints, constexprs) the persistent and stream-K kernels share, in their
    parameter order: A's and B's descriptors over the matrices as stored (K x M for an M-major A,
    N x K for a K-major B) in blocks of one K step, and the output's in blocks of ``out_n``
    columns where it is stored through one."""
    so_m, so_n = p.out_strides[2:]
    out_desc = config.get("STORE_DESC", True) and so_n == 1 and _aligned(so_m, _ITEMSIZE[p.dtypes[2]])
    c_strides = (p.c_strides or (0,) * 4)[2:]
    r_strides = (p.residual_strides or (0,) * 4)[2:]
    a_t, b_t = _tma_transposed(p.a_strides, p.dtypes[0]), _tma_transposed(p.b_strides, p.dtypes[1])
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    sa_m, sa_k = p.a_strides[2:]
    sb_k, sb_n = p.b_strides[2:]
    planes = 2 if p.tf32x3 else 1  # TF32 planes: heads over the first M (N) rows, tails after
    m, n = planes * p.m, planes * p.n
    descriptors = [
        Described((p.k, p.m), (sa_k, 1), (bk, bm)) if a_t else Described((m, p.k), (sa_m, 1), (bm, bk)),
        Described((n, p.k), (sb_n, 1), (bn, bk)) if b_t else Described((p.k, p.n), (sb_k, 1), (bk, bn)),
        Described((p.m, p.n), (so_m, 1), (bm, out_n)) if out_desc else None,
    ]
    ints = (p.m, p.n, p.k, so_m, so_n, *c_strides, *r_strides, p.bias_stride, programs)
    constexprs = (*_epilogue_constexprs(p), *_dot_constexprs(p)[:2], a_t, b_t, out_desc,
                  bm, bn, bk, config["GROUP_M"])  # fmt: skip
    return descriptors, ints, constexprs


def _persistent_launch(p: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
    """The persistent TMA kernel for ``p`` with ``config`` (see ``PersistentTmaEngine.configs``)."""
    # CTAS programs per SM: two small-tile programs share an SM, so one's epilogue can run while
    # the other's MMAs do (what a ping-pong kernel does with two consumer warp groups).
    k_chunk, split = _k_chunks(p, config)
    programs = min(config.get("CTAS", 1) * sm_count(), _tiles(p, config) * max(split, 1))
    subtile = config.get("SUBTILE", False)
    descriptors, ints, constexprs = _tma_arguments(p, config, programs, config["BLOCK_N"] // (1 + subtile))
    return launcher(
        _persistent_kernel,
        (programs,),
        num_tensors=10,
        ints=(*ints, k_chunk),
        constexprs=(*constexprs, config["FLATTEN"], subtile, split > 1),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        descriptors=descriptors,
    )


def _k_chunks(p: MatmulProblem, config: LaunchConfig) -> tuple[int, int]:
    """(K steps a chunk, chunks) of the persistent kernel's K split in ``config["SPLIT"]`` (1:
    one chunk of all the steps; 0 chunks for K = 0)."""
    k_steps = cdiv(p.k, config["BLOCK_K"])
    k_chunk = cdiv(k_steps, config.get("SPLIT", 1)) or 1
    return k_chunk, cdiv(k_steps, k_chunk)


def _split_tma_launch(p: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
    """The persistent kernel over (K chunk, tile) units, each chunk's fp32 partial product in its
    own slice of a workspace, then ``_reduce_kernel`` adding them in chunk order and running the
    epilogue: no program waits for or reads another's sums (``_stream_k_kernel``'s last arrivals
    did, and cost about 5 us per partial at GPT-2 small's 768 x 768 weight gradient)."""
    split = _k_chunks(p, config)[1]
    if split <= 1:
        return _persistent_launch(p, {**config, "SPLIT": 1})
    plain = dataclasses.replace(
        p, dtypes=(*p.dtypes[:2], "float32"), out_strides=(0, 0, p.n, 1), c_strides=None,
        residual_strides=None, bias=0, activation=-1, store_pre=False, scaled=False, amax=False,
    )  # fmt: skip
    partial = _persistent_launch(plain, {**config, "STORE_DESC": False, "SUBTILE": False})
    reduce = _reduce_launch(p, split)

    def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *rest: object) -> None:
        ws = torch.empty((split, p.m, p.n), dtype=torch.float32, device=out.device)
        tensors, floats = rest[:7], rest[7:]
        partial(a, b, ws, *tensors, 1.0, 0.0, *floats[2:])  # alpha and beta are the reduction's
        reduce(ws, out, *tensors, *floats)

    return run


def _reduce_launch(p: MatmulProblem, split: int) -> Callable[..., None]:
    """``_reduce_kernel`` for ``p``: ``split`` partial products [split, batch, M, N] in, ``p``'s
    output (with its epilogue) out."""
    rm, rn = 32, 64
    return launcher(
        _reduce_kernel,
        (cdiv(p.m, rm) * cdiv(p.n, rn) * p.batch,),
        num_tensors=9,
        ints=(p.m, p.n, p.batch_inner, p.batch, split, *p.out_strides, *_epilogue_strides(p)),
        constexprs=(*_epilogue_constexprs(p), p.index_64 or split * p.batch * p.m * p.n > 2**31 - 1, rm, rn),
        num_warps=4,
    )


def stream_k_schedule(tiles: int, k_steps: int, programs: int) -> tuple[int, int, int]:
    """(tiles done whole first, K steps a program in the rest, partial-sum slots a tile) for
    ``_stream_k_kernel``: all full waves but the last go whole; the last full wave and the partial
    one after it are shared out evenly (a wave's worth of whole tiles left in the shared part lets
    its split tiles' partial sums be few and large)."""
    whole = max(0, tiles // programs - 1) * programs
    span = cdiv((tiles - whole) * k_steps, programs)
    return whole, span, (k_steps - 1) // span + 2


def _stream_k_launch(p: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
    """The stream-K variant of the persistent kernel for ``p`` (``_stream_k_kernel``): one program
    an SM, its fp32 partial sums in a workspace allocated each call. ``SUMS_AFTER``: the split
    tiles are added up and finished by a second kernel (``_stream_k_sums_kernel``) rather than by
    each tile's last program to arrive."""
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    tiles, k_steps = _tiles(p, config), cdiv(p.k, config["BLOCK_K"])
    programs = min(sm_count(), tiles * k_steps)
    whole, span, slots = stream_k_schedule(tiles, k_steps, programs)
    sums_after = config.get("SUMS_AFTER", False)
    descriptors, ints, constexprs = _tma_arguments(p, config, programs, bn)
    launch = launcher(
        _stream_k_kernel,
        (programs,),
        num_tensors=12,
        ints=(*ints, whole, span, slots),
        constexprs=(*constexprs, sums_after),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
        descriptors=descriptors,
    )
    shared = tiles - whole
    counters = arrival_counters(shared)
    sums = None
    if sums_after:
        sub_m, sub_n = min(bm, 32), min(bn, 64)
        sums = launcher(
            _stream_k_sums_kernel,
            (shared * (bm // sub_m) * (bn // sub_n),),
            num_tensors=9,
            ints=(*ints[:-1], whole, span, slots),
            constexprs=(*_epilogue_constexprs(p), bm, bn, config["BLOCK_K"], config["GROUP_M"], sub_m, sub_n),
            num_warps=4,
        )

    def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *rest: object) -> None:
        ws = torch.empty(shared * slots * bm * bn, dtype=torch.float32, device=out.device)
        launch(a, b, out, *rest[:7], ws, counters(out), *rest[7:])
        if sums is not None:
            sums(ws, out, *rest)

    return run


def _split_launch(p: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
    """The K-split kernel (and, split in more than one, the reduction) as one callable."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    k_chunk = cdiv(cdiv(max(p.k, 1), config["SPLIT"]), bk) * bk
    split = max(1, cdiv(p.k, k_chunk))
    tiles = cdiv(p.m, bm) * cdiv(p.n, bn) * p.batch
    index_64 = p.index_64 or split * p.batch * p.m * p.n > 2**31 - 1
    acc, precision, upcast = _dot_constexprs(p)
    partial = launcher(
        _split_kernel,
        (tiles, split),
        num_tensors=11,
        ints=(p.m, p.n, p.k, p.batch_inner, p.batch, k_chunk, *_ints(p)),
        constexprs=(*_epilogue_constexprs(p), acc, precision, upcast, index_64, split, bm, bn, bk),
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if split == 1:
        return lambda *args: partial(*args[:10], args[2], *args[10:])
    reduce = _reduce_launch(p, split)
    ws_dtype = torch.float64 if p.dtypes[0] == "float64" else torch.float32

    def run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *rest: object) -> None:
        ws = torch.empty((split, p.batch, p.m, p.n), dtype=ws_dtype, device=out.device)
        tensors, floats = rest[:7], rest[7:]
        partial(a, b, out, *tensors, ws, *floats)
        reduce(ws, out, *tensors, *floats)

    return run


def _split_configs(
    p: MatmulProblem, tiles: list[tuple[int, int, int, int, int]], waves: int
) -> list[LaunchConfig]:
    """For each tile shape (BM, BN, BK, warps, stages) that fits: the largest power-of-two split
    keeping the programs within ``waves`` times the SMs, then half and double that split."""
    configs = []
    for bm, bn, bk, warps, stages in tiles:
        if not _fits(bm, bn, bk, warps, stages, _ITEMSIZE[p.dtypes[0]]):
            continue
        programs = cdiv(p.m, bm) * cdiv(p.n, bn) * p.batch
        most = max(1, p.k // (2 * bk))  # at least two K blocks per split
        split = 1
        while split * 2 <= most and programs * split * 2 <= waves * sm_count():
            split *= 2
        for s in (split, split // 2, split * 2):
            c = {**_tile(bm, bn, bk, warps, stages), "SPLIT": max(1, min(s, most))}
            if c not in configs:
                configs.append(c)
    return configs


def _in_place_rate(p: MatmulProblem) -> float:
    """The share of their usual rate kernels reading operands in place keep: a fifth when an
    operand has no aligned contiguous dimension, read a value per load (H100, bf16 logits 8192 x
    50257 against 768 features: 105 TFLOP/s tiled, 165-190 split-K; see ``_repacks``); a quarter
    for TF32 with an operand that is not K-major on Hopper, whose MMAs then wait on a transposed
    copy of each tile (88 TFLOP/s on H100; see ``_tf32_repacks``: the tiled and split-K kernels
    alike)."""
    rate = 0.2 if any(_unaligned(p)) else 1.0
    if p.tf32x3:  # Triton splits the tiles in registers: 57-61 TFLOP/s on H200, planes 92-107
        rate *= 0.55
    return rate * 0.25 if any(_tf32_repacks(p)) and hopper() else rate


def _split_cost(p: MatmulProblem, config: LaunchConfig, compute_eff: float, bandwidth_eff: float) -> float:
    compute_eff *= _in_place_rate(p)
    programs = cdiv(p.m, config["BLOCK_M"]) * cdiv(p.n, config["BLOCK_N"]) * p.batch * config["SPLIT"]
    split = config["SPLIT"]
    extra = 8 * split * p.batch * p.m * p.n if split > 1 else 0  # the fp32 partials, written and read
    util = min(1.0, programs / sm_count())
    if _long_k(p) and p.m > SKINNY_M:
        # Priced as the other kernels' long tiles are (at the small tiles' lower rates; several
        # programs share an SM, so their waves count fractionally). H100, bf16, K = 8192: 768x768
        # 64x64 split in 2 ran 36.7 us (64x128 tiles whole 45-47), 3072x768 125 (128x256 83-86).
        waves = max(1.0, programs / sm_count())
        compute = _long_k_us(config["BLOCK_M"], config["BLOCK_N"], cdiv(p.k, split), waves)
        return compute / _in_place_rate(p) + extra / (_BANDWIDTH * 1e6) + 4
    compute_eff *= _wave_util_of(p, programs)
    return _roofline(p, compute_eff, bandwidth_eff * util, extra) + (8 if split > 1 else 4)


@FAMILY.register
class SplitKEngine(Engine[MatmulProblem]):
    """Few output tiles, long K: each tile's K range is split over several programs, partial sums
    go to an fp32 workspace and a second kernel adds them in a fixed order (deterministic)."""

    name = "split-k"

    def not_supported_reasons(self, problem: MatmulProblem) -> list[str]:
        reasons = _interpreter_reasons(problem)
        if problem.k < 256:  # shorter, a split-K program is the tiled kernel's with small tiles
            reasons.append(f"K={problem.k} is too short to split (under four blocks of 64)")
        return reasons

    def cost(self, problem: MatmulProblem) -> float:
        # fp32 on the FMA units over long K: split-K's programs ran at the tiled kernel's rate (see
        # _wave_util_of); over K=512 (16384x2048) 3.7x slower than it.
        fma = problem.dtypes[0] == "float32" and not problem.tf32 and problem.k >= LONG_K
        return _split_cost(problem, self.configs(problem)[0], 0.75 if fma else 0.6, 0.7)

    def configs(self, problem: MatmulProblem) -> list[LaunchConfig]:
        if problem.fp8:
            tiles = [(64, 64, 128, 4, 4), (64, 128, 128, 4, 4)]
        elif problem.dtypes[0] == "float64":
            tiles = [(32, 32, 32, 4, 2)]
        else:
            tiles = [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4)]
        configs = _split_configs(problem, tiles, 2)
        return [c for c in configs if c["SPLIT"] > 1] or configs[:1]

    def bind(self, problem: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
        return _split_launch(problem, config)


@FAMILY.register
class SkinnyEngine(Engine[MatmulProblem]):
    """Decode-style M of 1 to 64: all rows in one tile, programs over N (and K, split to fill the
    SMs), bound by reading B once. M = 1 runs without tensor cores (a GEMV)."""

    name = "skinny"

    def not_supported_reasons(self, problem: MatmulProblem) -> list[str]:
        reasons = _interpreter_reasons(problem)
        if problem.m > SKINNY_M:
            reasons.append(f"M={problem.m} rows exceed {SKINNY_M}")
        return reasons

    def cost(self, problem: MatmulProblem) -> float:
        # Measured on H100 (bf16, N = K = 8192): 2.2 TB/s, as cuBLAS, for M of 1 to 64.
        return _split_cost(problem, self.configs(problem)[0], 0.3, 0.75)

    def configs(self, problem: MatmulProblem) -> list[LaunchConfig]:
        m = problem.m
        bm = 1 if m == 1 else 16 if m <= 16 else 32 if m <= 32 else 64
        # Measured on H100 (bf16, N = K = 8192): one row wants about 4 programs per SM (split K),
        # 16 to 64 rows one program per SM (no split).
        if bm == 1:
            tiles, waves = [(1, 32, 256, 4, 3), (1, 64, 128, 4, 4), (1, 128, 64, 4, 4)], 4
        elif problem.fp8:
            tiles, waves = [(bm, 64, 256, 4, 4), (bm, 128, 128, 4, 4)], 1
        elif problem.dtypes[0] == "float64":
            tiles, waves = [(bm, 32, 32, 4, 2)], 1
        else:
            tiles = [(bm, 64, 128, 4, 4), (bm, 64, 256, 8, 3), (bm, 32, 128, 4, 4), (bm, 128, 64, 4, 4)]
            waves = 1
        return _split_configs(problem, tiles, waves)

    def bind(self, problem: MatmulProblem, config: LaunchConfig) -> Callable[..., None]:
        return _split_launch(problem, config)
