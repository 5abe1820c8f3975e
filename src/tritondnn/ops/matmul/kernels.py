"""Matmul kernels for any GPU: the tiled tensor-core kernel, the K-split kernel (split-K and skinny
M) with its deterministic reduction, and the backward epilogue (activation gradient and bias sums).

Arguments shared by the kernels, documented once:

* Tensors, in order: ``a`` [batch, M, K], ``b`` [batch, K, N], ``out`` [batch, M, N] and the
  epilogue's ``c``, ``bias``, ``res`` (residual), ``pre`` (pre-activation, laid out as ``out``),
  ``scale_a``, ``scale_b`` (fp8 per-tensor scales, one fp32 each), ``amax`` (one fp32, starts at
  0). Tensors an epilogue flag leaves off are never read: the host passes ``out`` in their place.
* Floats: ``alpha``, ``beta``, ``p0``, ``p1`` (see ``ops.epilogue``).
* Ints: ``M``, ``N``, ``K``; ``batch_inner``: the batch is two merged dimensions (outer, inner),
  batch index ``t`` is ``(t // batch_inner, t % batch_inner)``; strides ``s<x>_o, s<x>_i`` over
  them and ``s<x>_<row>, s<x>_<col>`` over the matrix, for x in a (m, k), b (k, n), o (out and
  pre: m, n), c and r (residual: m, n); stride 0 broadcasts. ``s_bias`` steps the bias vector.
* Constexprs: the epilogue flags ``HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE`` (``apply_epilogue``),
  ``SCALED`` (multiply by scale_a * scale_b first), ``AMAX`` (record max |out|); ``PRECISION`` is
  tl.dot's input_precision ("ieee", "tf32" or "tf32x3" for fp32), or "fast" for fp8 accumulated in the
  tensor cores over the whole K loop (``use_fast_accum``); ``UPCAST`` makes dots on fp32 copies of
  the tiles (the interpreter computes bf16 dots wrongly); ``ACC`` is the accumulator dtype (fp64
  for fp64 operands, else fp32); ``INDEX_64`` computes offsets in int64 (some tensor spans 2**31
  elements or more).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.arrival import last_arrival
from ...core.numerics import convert
from ..activation import activation_gradient
from ..epilogue import apply_epilogue, reduce_amax


@triton.jit
def grouped(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of ``tile``, walking GROUP_M tile-rows at a time down each column of tiles, so
    the programs running together share A and B tiles in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_m
    pid_n = (tile % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # bf16 under the interpreter: products of bf16 values are exact in fp32
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif a.dtype.is_fp8() and PRECISION == "fast":
        return tl.dot(a, b, acc, out_dtype=tl.float32)
    elif a.dtype.is_fp8():
        # Hopper's fp8 MMAs keep fewer accumulator bits than fp32, and Triton lets them run a
        # whole K loop so (max_num_imprecise_acc 2**30); promoting to fp32 once per K tile keeps
        # the long-K error at the fp32 level, as cuBLAS does by default.
        return tl.dot(a, b, acc, out_dtype=tl.float32, max_num_imprecise_acc=a.shape[1])
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=acc.dtype)


@triton.jit
def epilogue_tile(
    acc, rows, cols, batch, M, N, batch_inner,
    c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
):  # fmt: skip
    """The finished accumulator tile (rows x cols) of matrix ``batch``: scaled, through the
    epilogue, its amax recorded; the caller stores it."""
    bo = batch // batch_inner
    bi = batch % batch_inner
    if SCALED:
        acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    y = apply_epilogue(
        acc, rows, cols, M, N,
        c_ptr + bo * sc_o + bi * sc_i, sc_m, sc_n, bias_ptr, s_bias,
        res_ptr + bo * sr_o + bi * sr_i, sr_m, sr_n, pre_ptr + bo * so_o + bi * so_i, so_m, so_n,
        alpha, beta, p0, p1, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE,
    )  # fmt: skip
    if AMAX:
        reduce_amax(y, (rows < M)[:, None] & (cols < N)[None, :], amax_ptr)
    return y


@triton.jit
def finish_tile(
    acc, rows, cols, batch, M, N, batch_inner,
    out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
):  # fmt: skip
    """``epilogue_tile``, then store the tile into ``out`` (masked, cast to out's dtype)."""
    y = epilogue_tile(
        acc, rows, cols, batch, M, N, batch_inner,
        c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
        alpha, beta, p0, p1,
        so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
    )  # fmt: skip
    o_off = (batch // batch_inner) * so_o + (batch % batch_inner) * so_i
    out_ptrs = out_ptr + o_off + rows[:, None] * so_m + cols[None, :] * so_n
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptrs, convert(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tiled_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    M, N, K, batch_inner,
    sa_o, sa_i, sa_m, sa_k, sb_o, sb_i, sb_k, sb_n, so_o, so_i, so_m, so_n,
    sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One BLOCK_M x BLOCK_N output tile per program; the grid is (tiles per matrix * batch,).

    Operands are read through their strides, so transposed and broadcast ones need no copy.
    EVEN_K: K is a multiple of BLOCK_K, so the K loop loads without masks.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    batch = pid // (tiles_m * tiles_n)
    pid_m, pid_n = grouped(pid % (tiles_m * tiles_n), tiles_m, tiles_n, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Rows and columns past the edge wrap around to valid ones: the loads need no M/N mask, and
    # what they compute is never stored.
    bo = batch // batch_inner
    bi = batch % batch_inner
    a_ptrs = a_ptr + bo * sa_o + bi * sa_i + (rows % M)[:, None] * sa_m + ks[None, :] * sa_k
    b_ptrs = b_ptr + bo * sb_o + bi * sb_i + ks[:, None] * sb_k + (cols % N)[None, :] * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=ks[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < K - k0, other=0.0)
        acc = dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * sa_k
        b_ptrs += BLOCK_K * sb_k
    finish_tile(
        acc, rows, cols, batch, M, N, batch_inner,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
        alpha, beta, p0, p1,
        so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
    )  # fmt: skip


@triton.jit
def _split_kernel(
    a_ptr, b_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr, ws_ptr,
    alpha, beta, p0, p1,
    M, N, K, batch_inner, batches, k_chunk,
    sa_o, sa_i, sa_m, sa_k, sb_o, sb_i, sb_k, sb_n, so_o, so_i, so_m, so_n,
    sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, INDEX_64: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program (tile, s) multiplies over K in [s * k_chunk, (s + 1) * k_chunk) (k_chunk: a multiple
    of BLOCK_K). Grid: (tiles per matrix * batch, SPLIT).

    SPLIT == 1: the tile is finished here (epilogue and store). Otherwise its fp32 partial goes to
    ``ws`` [SPLIT, batch, M, N] (contiguous) for ``_reduce_kernel``: no atomics, so the sum is
    the same on every run. BLOCK_M < 16 (decode-style M of 1 to 8) multiplies on the CUDA cores
    (broadcast products summed over K): tl.dot needs 16 rows, and the kernel is bound by reading
    B anyway.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    if INDEX_64:
        pid = pid.to(tl.int64)
    batch = pid // (tiles_m * tiles_n)
    tile = pid % (tiles_m * tiles_n)
    pid_m = tile // tiles_n  # neighbouring programs share the A rows (few, in the skinny case)
    pid_n = tile % tiles_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_chunk
    k_end = tl.minimum(K, k_start + k_chunk)
    kr = tl.arange(0, BLOCK_K)
    ks = k_start + kr
    bo = batch // batch_inner
    bi = batch % batch_inner
    a_ptrs = a_ptr + bo * sa_o + bi * sa_i + (rows % M)[:, None] * sa_m + ks[None, :] * sa_k
    b_ptrs = b_ptr + bo * sb_o + bi * sb_i + ks[:, None] * sb_k + (cols % N)[None, :] * sb_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = tl.load(a_ptrs, mask=kr[None, :] < k_end - k0, other=0.0)
        b = tl.load(b_ptrs, mask=kr[:, None] < k_end - k0, other=0.0)
        if BLOCK_M < 16:
            acc += tl.sum(a.to(acc.dtype)[:, :, None] * b.to(acc.dtype)[None, :, :], axis=1)
        else:
            acc = dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * sa_k
        b_ptrs += BLOCK_K * sb_k
    if SPLIT == 1:
        finish_tile(
            acc, rows, cols, batch, M, N, batch_inner,
            out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
            alpha, beta, p0, p1,
            so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
            HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
        )  # fmt: skip
    else:
        ws_rows = (split * batches + batch) * M + rows
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(ws_ptr + ws_rows[:, None] * N + cols[None, :], acc, mask=mask)


@triton.jit
def _reduce_kernel(
    ws_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    M, N, batch_inner, batches, split,
    so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Sum the ``split`` partials in ``ws`` [split, batch, M, N] in a fixed order, then finish the
    tile. Grid: (tiles per matrix * batch,)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    if INDEX_64:
        pid = pid.to(tl.int64)
    batch = pid // (tiles_m * tiles_n)
    tile = pid % (tiles_m * tiles_n)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    ptrs = ws_ptr + (batch * M + rows)[:, None] * N + cols[None, :]
    step = batches * M * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), ws_ptr.dtype.element_ty)
    for _ in range(split):
        acc += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += step
    finish_tile(
        acc, rows, cols, batch, M, N, batch_inner,
        out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
        alpha, beta, p0, p1,
        so_o, so_i, so_m, so_n, sc_o, sc_i, sc_m, sc_n, sr_o, sr_i, sr_m, sr_n, s_bias,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
    )  # fmt: skip


@triton.jit
def _grad_epilogue_kernel(
    g_ptr, pre_ptr, dpre_ptr, ws_ptr, db_ptr, counter_ptr,
    p0, p1,
    R, C, rows_inner, rows_chunk,
    sg_o, sg_r, sg_c, sp_o, sp_r, sp_c, sd_o, sd_r, sd_c,
    ACT: tl.constexpr, DBIAS: tl.constexpr, ACC: tl.constexpr, INDEX_64: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The epilogue's backward: dpre = g * act'(pre) and the bias gradient, the sum of dpre over rows.

    g (output gradient), pre, dpre: R x C, a row r at ``(r // rows_inner) * s_o + (r % rows_inner)
    * s_r`` (batches of rows_inner rows). A per-column bias sums over rows = (batch, M); a per-row
    bias is the same walk with M and N exchanged. Grid: (cdiv(C, BLOCK_C), chunks): program
    (j, s) covers rows [s * rows_chunk, (s + 1) * rows_chunk) and writes its column sums to
    ``ws`` [chunks, C] (fp32, fp64 for fp64); the last program of column block j to arrive on
    ``counter[j]`` adds the chunks' sums, BLOCK_K chunks a load, in a fixed order (the same bits
    whoever arrives last) and stores ``db``. ACT < 0: dpre is g and is not written.
    """
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    chunk = tl.program_id(1)
    if INDEX_64:
        chunk = chunk.to(tl.int64)
    col_ok = cols < C
    r_start = chunk * rows_chunk
    r_end = tl.minimum(R, r_start + rows_chunk)
    total = tl.zeros((BLOCK_R, BLOCK_C), ACC)
    for r0 in range(r_start, r_end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < r_end)[:, None] & col_ok[None, :]
        ro = rows // rows_inner
        ri = rows % rows_inner
        g = tl.load(g_ptr + (ro * sg_o + ri * sg_r)[:, None] + cols[None, :] * sg_c, mask=mask, other=0.0)
        d = convert(g, total.dtype)
        if ACT >= 0:
            s = tl.load(
                pre_ptr + (ro * sp_o + ri * sp_r)[:, None] + cols[None, :] * sp_c, mask=mask, other=0.0
            )
            x = convert(s, total.dtype)
            d = activation_gradient(d, x, ACT, False, p0, p1)
            d_ptrs = dpre_ptr + (ro * sd_o + ri * sd_r)[:, None] + cols[None, :] * sd_c
            tl.store(d_ptrs, convert(d, dpre_ptr.dtype.element_ty), mask=mask)
            # The bias gradient sums dpre as stored, the tensor autograd would have summed.
            d = convert(convert(d, dpre_ptr.dtype.element_ty), total.dtype)
        if DBIAS:
            total += tl.where(mask, d, 0.0)
    if DBIAS:
        tl.store(ws_ptr + chunk * C + cols, tl.sum(total, 0), mask=col_ok)
        chunks = tl.num_programs(1)
        if last_arrival(counter_ptr + tl.program_id(0), chunks):
            k = tl.arange(0, BLOCK_K)[:, None]
            sums = tl.zeros((BLOCK_K, BLOCK_C), ACC)
            for k0 in range(0, chunks, BLOCK_K):
                mask = (k0 + k < chunks) & col_ok[None, :]
                at = ws_ptr + (k0 + k) * C + cols[None, :]
                sums += tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(db_ptr + cols, convert(tl.sum(sums, 0), db_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _tf32_planes_kernel(
    x_ptr, out_ptr, R, C, sx_r, sx_c, ld, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):  # fmt: skip
    """Splits the fp32 matrix X (R x C, any strides) into planes for three TF32 products: row r of
    ``out`` (row stride ``ld``) holds X's row r's TF32 head (its top 10 mantissa bits, which a
    TF32 MMA reads exactly), row R + r the tail (X minus the head, exact in fp32). A stride of 1
    is specialized, so an M-major X is read along its columns and the tile turned in shared
    memory. Grid: (row blocks, column blocks)."""
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (r < R)[:, None] & (c < C)[None, :]
    x = tl.load(x_ptr + r[:, None] * sx_r + c[None, :] * sx_c, mask=mask)
    head = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    at = out_ptr + r[:, None] * ld + c[None, :]
    tl.store(at, head, mask=mask)
    tl.store(at + R * ld, x - head, mask=mask)
