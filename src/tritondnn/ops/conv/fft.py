"""FFT convolution for large filters (stride 1, one group): transforms through ``torch.fft``, the
per-frequency channel contraction in Triton.

With the input zero-padded to L per dimension (L at least the padded input), the cross-correlation
is ``y = irfft(X * conj(W))`` cropped to the output: for each frequency f, a complex GEMM
``Y[f] (N x Cout) = X[f] (N x Cin) @ conj(W[f])^T``. Its cost grows with log L instead of the
filter's taps, so it pays for 7x7 and larger filters on many channels. Transforms run in fp32
(fp64 for fp64 inputs); fp16/bf16 inputs are widened and the result rounded once. Rounding error
grows like log2(L) times fp32's: tests bound it by 2x PyTorch's fp32 error plus 1e-5 x sum|x||w|.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET
from ...core.engine import Engine, LaunchConfig
from ...core.launcher import cdiv, launcher
from ..matmul.kernels import dot
from .engines import FAMILY, dot_constexprs, epilogue_torch, roofline
from .problem import ConvProblem


@triton.jit
def _contract_kernel(
    x_ptr, w_ptr, y_ptr,
    N, COUT, CIN, sx_f, sx_n, sx_c, sw_f, sw_c, sw_o, sy_f, sy_n, sy_o,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Y[f, n, o] = sum over c of X[f, n, c] * conj(W[f, c, o]) for complex tensors stored as
    (real, imaginary) pairs (the real part at the element offset, the imaginary one after it;
    strides count real elements). Grid: (frequencies, cdiv(N, BLOCK_M) * cdiv(COUT, BLOCK_N))."""
    f = tl.program_id(0).to(tl.int64)
    tiles_n = tl.cdiv(COUT, BLOCK_N)
    rows = (tl.program_id(1) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(1) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc_r = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    acc_i = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    acc_t = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    x_rows = x_ptr + f * sx_f + rows[:, None] * sx_n
    w_cols = w_ptr + f * sw_f + cols[None, :] * sw_o
    for k0 in range(0, CIN, BLOCK_K):
        k = k0 + ks
        xm = (rows < N)[:, None] & (k < CIN)[None, :]
        wm = (k < CIN)[:, None] & (cols < COUT)[None, :]
        xr = tl.load(x_rows + k[None, :] * sx_c, mask=xm, other=0.0)
        xi = tl.load(x_rows + k[None, :] * sx_c + 1, mask=xm, other=0.0)
        wr = tl.load(w_cols + k[:, None] * sw_c, mask=wm, other=0.0)
        wi = tl.load(w_cols + k[:, None] * sw_c + 1, mask=wm, other=0.0)
        # (xr + i xi)(wr - i wi) = xr wr + xi wi + i (xi wr - xr wi)
        acc_r = dot(xr, wr, acc_r, PRECISION, UPCAST)
        acc_r = dot(xi, wi, acc_r, PRECISION, UPCAST)
        acc_i = dot(xi, wr, acc_i, PRECISION, UPCAST)
        acc_t = dot(xr, wi, acc_t, PRECISION, UPCAST)
    mask = (rows < N)[:, None] & (cols < COUT)[None, :]
    y = y_ptr + f * sy_f + rows[:, None] * sy_n + cols[None, :] * sy_o
    tl.store(y, acc_r, mask=mask)
    tl.store(y + 1, acc_i - acc_t, mask=mask)


def _good_size(n: int) -> int:
    """The smallest size >= n whose only prime factors are 2, 3 and 5 (fast FFT lengths)."""
    while True:
        m = n
        for q in (2, 3, 5):
            while m % q == 0:
                m //= q
        if m == 1:
            return n
        n += 1


@FAMILY.register
class FftEngine(Engine[ConvProblem]):
    """Stride 1, one group, any dilation (the filter is dilated before its transform)."""

    name = "fft"

    def not_supported_reasons(self, problem: ConvProblem) -> list[str]:
        p = problem
        reasons = []
        if p.stride != (1, 1, 1):
            reasons.append(f"needs stride 1 (got {p.stride[3 - p.nd :]})")
        if p.groups != 1:
            reasons.append(f"needs groups == 1 (got {p.groups})")
        return reasons

    def _sizes(self, p: ConvProblem) -> list[int]:
        lens = []
        for i in range(3 - p.nd, 3):
            extent = (p.out_size[i] - 1) + p.dilation[i] * (p.kernel[i] - 1) + 1
            lens.append(_good_size(extent))
        return lens

    def cost(self, problem: ConvProblem) -> float:
        p = problem
        lens = self._sizes(p)
        volume = 1
        for s in lens:
            volume *= s
        freqs = volume // lens[-1] * (lens[-1] // 2 + 1)
        contraction = 8.0 * freqs * p.n * p.cin * p.cout
        fft_bytes = 8 * freqs * (p.n * p.cin + p.cin * p.cout + p.n * p.cout) * 3
        tflops = 300.0 if p.tf32 else 45.0
        # Measured on an H100 (fp32 3x3 ResNet layers, N=64): 1.2-1.5 ms, about 8% of this model's
        # peak for the contraction, where the implicit GEMM ran the same layers at 23 TFLOP/s.
        return roofline(contraction, p.bytes + fft_bytes, tflops, 0.08, 0.5) + 60.0

    def bind(self, problem: ConvProblem, config: LaunchConfig) -> Callable[..., None]:
        p = problem
        nd = p.nd
        lens = self._sizes(p)
        dims = tuple(range(2, 2 + nd))
        wide = torch.float64 if p.dtype == "float64" else torch.float32
        acc, precision, _ = dot_constexprs(p)
        bm, bn, bk = (16, 16, 16) if INTERPRET else (32, 64, 32)
        pads = []
        for i in reversed(range(3 - nd, 3)):
            extent = lens[i - (3 - nd)]
            pads += [p.pad[i], extent - p.in_size[i] - p.pad[i]]

        freqs = 1
        for s in lens[:-1]:
            freqs *= s
        freqs *= lens[-1] // 2 + 1
        # Contiguous (freq, N, Cin, 2), (freq, Cin, Cout, 2), (freq, N, Cout, 2) in real elements.
        strides = (
            2 * p.n * p.cin,
            2 * p.cin,
            2,
            2 * p.cin * p.cout,
            2 * p.cout,
            2,
            2 * p.n * p.cout,
            2 * p.cout,
            2,
        )
        launch = launcher(
            _contract_kernel,
            (freqs, cdiv(p.n, bm) * cdiv(p.cout, bn)),
            3,
            (p.n, p.cout, p.cin, *strides),
            (acc, precision, False, bm, bn, bk),
        )

        def run(x, w, y, c, bias, residual, pre, alpha, beta, p0, p1) -> None:
            xp = torch.nn.functional.pad(x.to(wide), pads)[(..., *tuple(slice(0, s) for s in lens))]
            wd = w.to(wide)
            if any(d != 1 for d in p.dilation):
                kd = [(k - 1) * d + 1 for k, d in zip(p.kernel[3 - nd :], p.dilation[3 - nd :])]
                full = wd.new_zeros((p.cout, p.cin, *kd))
                full[
                    (slice(None), slice(None), *tuple(slice(None, None, d) for d in p.dilation[3 - nd :]))
                ] = wd
                wd = full
            xf = torch.fft.rfftn(xp, s=lens, dim=dims).movedim(0, -1).movedim(0, -1)  # (*freq, N, Cin)
            wf = torch.fft.rfftn(wd, s=lens, dim=dims).permute(*range(2, 2 + nd), 1, 0)  # (*freq, Cin, Cout)
            freq_shape = xf.shape[:nd]
            xf = torch.view_as_real(xf.reshape(-1, p.n, p.cin).contiguous())
            wf = torch.view_as_real(wf.reshape(-1, p.cin, p.cout).contiguous())
            yf = torch.empty((freqs, p.n, p.cout, 2), dtype=wide, device=x.device)
            launch(xf, wf, yf)
            yc = torch.view_as_complex(yf).reshape(*freq_shape, p.n, p.cout).movedim(-1, 0).movedim(-1, 0)
            full_y = torch.fft.irfftn(yc, s=lens, dim=dims)
            out = full_y[(..., *tuple(slice(0, o) for o in p.out_size[3 - nd :]))]
            res, pre_v = epilogue_torch(
                out,
                p,
                c if p.has_c else None,
                bias if p.bias else None,
                residual if p.residual else None,
                alpha,
                beta,
                p0,
                p1,
            )
            y.copy_(res)
            if p.store_pre:
                pre.copy_(pre_v)

        return run
