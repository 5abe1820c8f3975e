"""The Hopper kernel: persistent programs loading tiles through tensor descriptors (TMA).

One program per SM walks the output tiles (grouped order, as the tiled kernel), so tile setup and
the epilogue of one tile overlap the loads of the next, and the copy engine moves A and B tiles
into shared memory without registers or address arithmetic. The descriptors of A, B and (where
stored through one) the output are made on the host (``core.launcher.Described``) and passed by
value: made on the device, each program wrote its own into global memory and fenced before its
first load, and GPT-2 small's 8192 x 768 x 768 product took 19.3 us against 16.9 with host-made
ones (H200). Out-of-bounds parts of a tile load as zeros, so neither K nor the edges need masks.

Requirements (checked by the engine): one matrix (no batch); each operand has one contiguous
dimension and 16-byte-aligned rows (strides and base address); Triton compiled for sm_90+.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.arrival import last_arrival
from ...core.numerics import convert
from .kernels import dot, epilogue_tile, finish_tile, grouped


@triton.jit
def _persistent_kernel(
    a_desc, b_desc, out, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    M, N, K, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias, programs, k_chunk,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    OUT_DESC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, FLATTEN: tl.constexpr, SUBTILE: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Arguments as ``kernels._tiled_kernel`` without the batch; ``programs``: the grid size;
    ``k_chunk``: K steps a unit of work takes (all of them unless SPLIT_K).

    a_desc, b_desc: descriptors of A and B as stored, blocks of a tile's K step (see
    ``engines._tma_arguments``).
    A_T: A's M dimension is the contiguous one (a transposed view), so its descriptor covers the
    stored K x M matrix and tiles are transposed after loading; otherwise K is. B_T: B's K
    dimension is contiguous (B = W.T of a row-major weight), its descriptor over N x K; otherwise
    N is. OUT_DESC: ``out`` is a descriptor of the output (so_n == 1, aligned rows), blocks
    of the columns an epilogue stores; otherwise a pointer. FLATTEN: Triton pipelines the tile
    and K loops as one, so the next tile's loads are issued during this tile's epilogue. SUBTILE:
    the epilogue runs on the tile's two column halves in turn, so the first half's store is under
    way while the second is computed. SPLIT_K: the units are (K chunk, tile) pairs, chunk-major, and
    each stores its fp32 partial product, unfinished, into its chunk's M x N slice of ``out`` (a
    workspace for ``kernels._reduce_kernel``; the epilogue constexprs are off); K chunks in step
    let the programs running at once share their A and B tiles in L2.
    """
    OUT_N: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    units = tiles * tl.cdiv(k_tiles, k_chunk) if SPLIT_K else tiles
    # The epilogue finds its unit from a counter of its own: with the loops flattened, what the top
    # of the body computes may already belong to the next unit.
    unit_done = tl.program_id(0) - programs
    for unit in tl.range(tl.program_id(0), units, programs, flatten=FLATTEN):
        k0 = (unit // tiles) * k_chunk if SPLIT_K else 0
        k1 = tl.minimum(k0 + k_chunk, k_tiles) if SPLIT_K else k_tiles
        pid_m, pid_n = grouped(unit % tiles if SPLIT_K else unit, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = _k_steps(
            a_desc, b_desc, off_m, off_n, k0, k1, tl.zeros((BLOCK_M, BLOCK_N), ACC), M, N, PRECISION,
            A_T, B_T, BLOCK_K,
        )  # fmt: skip
        unit_done += programs
        pid_m, pid_n = grouped(unit_done % tiles if SPLIT_K else unit_done, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        dst = out
        if SPLIT_K:  # this K chunk's partial product, in its own M x N slice of a workspace
            dst = out + (unit_done // tiles).to(tl.int64) * M * so_m
        last = acc
        if SUBTILE:  # the left half first, then the right one as the last
            left, last = acc.reshape(BLOCK_M, 2, OUT_N).permute(0, 2, 1).split()
            _finish(
                left, off_m, off_n, dst, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr,
                scale_b_ptr, amax_ptr, alpha, beta, p0, p1, M, N, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias,
                HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX, OUT_DESC, OUT_N,
            )  # fmt: skip
            off_n += OUT_N
        _finish(
            last, off_m, off_n, dst, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr,
            scale_b_ptr, amax_ptr, alpha, beta, p0, p1, M, N, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias,
            HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX, OUT_DESC, OUT_N,
        )  # fmt: skip


@triton.jit
def _stream_k_kernel(
    a_desc, b_desc, out, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    ws_ptr, counter_ptr,
    alpha, beta, p0, p1,
    M, N, K, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias, programs,
    dp_tiles, span, slots,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, A_T: tl.constexpr, B_T: tl.constexpr,
    OUT_DESC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SUMS_AFTER: tl.constexpr,
):  # fmt: skip
    """``_persistent_kernel``'s product with the last wave's work split evenly over K (stream-K):
    where the tiles do not fill the last wave of SMs (GPT-2 small's MLP weight gradients: 144
    tiles of 128x128 on 132 SMs, K = 8192), the programs share the last tiles' K loops instead of
    some idling.

    The first ``dp_tiles`` tiles go whole, ``programs`` apart, as in ``_persistent_kernel``. The
    rest are one run of (tile, K step) iterations, ``span`` of them a program: a program's run may
    end inside a tile, whose next program goes on from there. A program holding a whole tile
    stores it; one holding part of a tile stores its fp32 partial sum in slot (its index - the
    tile's first program's) of the tile's ``slots`` in ``ws`` and arrives on the tile's counter;
    the last to arrive adds the tile's partials in slot order (the same bits whoever arrives last)
    and runs the epilogue. No program waits for another. The output's blocks (OUT_DESC) are whole
    tiles. SUMS_AFTER: no arrivals; ``_stream_k_sums_kernel``, launched next, adds every split
    tile's partials (in the same slot order) and runs its epilogue.
    """
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    for tile in tl.range(pid, dp_tiles, programs):
        pid_m, pid_n = grouped(tile, tiles_m, tiles_n, GROUP_M)
        acc = _k_steps(
            a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, k_tiles, tl.zeros((BLOCK_M, BLOCK_N), ACC),
            M, N, PRECISION, A_T, B_T, BLOCK_K,
        )  # fmt: skip
        _finish(
            acc, pid_m * BLOCK_M, pid_n * BLOCK_N, out, c_ptr, bias_ptr, res_ptr, pre_ptr,
            scale_a_ptr, scale_b_ptr, amax_ptr, alpha, beta, p0, p1, M, N, so_m, so_n, sc_m, sc_n, sr_m, sr_n,
            s_bias, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX, OUT_DESC, BLOCK_N,
        )  # fmt: skip
    steps = (tiles_m * tiles_n - dp_tiles) * k_tiles
    start = pid * span
    end = tl.minimum(start + span, steps)
    first_tile = start // k_tiles  # indices among the shared tiles
    last_tile = (end - 1) // k_tiles
    tile_elems: tl.constexpr = BLOCK_M * BLOCK_N
    at = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    # The pieces in K order: the last tile's starts at K = 0, the first's where the previous
    # program stopped. Every program then works at about the same K at once, so their A and B
    # tiles are shared in L2; taken in tile order, the programs' K offsets were spread over all of
    # K, and a weight gradient over 8192 tokens ran 25-40% slower (H200).
    for j in range(0, last_tile - first_tile + 1):
        shared = last_tile - j
        k0 = tl.maximum(start - shared * k_tiles, 0)
        k1 = tl.minimum(end - shared * k_tiles, k_tiles)
        pid_m, pid_n = grouped(dp_tiles + shared, tiles_m, tiles_n, GROUP_M)
        acc = _k_steps(
            a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k0, k1, tl.zeros((BLOCK_M, BLOCK_N), ACC),
            M, N, PRECISION, A_T, B_T, BLOCK_K,
        )  # fmt: skip
        whole = (k0 == 0) & (k1 == k_tiles)
        if not whole:
            first = (shared * k_tiles) // span
            parts = ((shared + 1) * k_tiles - 1) // span - first + 1
            tile_ws = ws_ptr + shared * slots * tile_elems
            tl.store(tile_ws + (pid - first) * tile_elems + at, acc)
            if not SUMS_AFTER:
                whole = last_arrival(counter_ptr + shared, parts)
            if whole:
                # Every part loaded, its own too: keeping its own in registers beside the running
                # sum (for the same order) made ptxas spill at 128x256 and 128x128 (sm_90).
                acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
                for part in range(parts):
                    acc += tl.load(tile_ws + part * tile_elems + at, cache_modifier=".cg")
        if whole:
            _finish(
                acc, pid_m * BLOCK_M, pid_n * BLOCK_N, out, c_ptr, bias_ptr, res_ptr, pre_ptr,
                scale_a_ptr, scale_b_ptr, amax_ptr, alpha, beta, p0, p1, M, N, so_m, so_n, sc_m, sc_n, sr_m,
                sr_n, s_bias, HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX, OUT_DESC, BLOCK_N,
            )  # fmt: skip


@triton.jit
def _stream_k_sums_kernel(
    ws_ptr, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
    alpha, beta, p0, p1,
    M, N, K, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias, dp_tiles, span, slots,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SUB_M: tl.constexpr, SUB_N: tl.constexpr,
):  # fmt: skip
    """The split tiles of a ``_stream_k_kernel`` launch with SUMS_AFTER (same schedule arguments):
    each program adds the partial sums of one SUB_M x SUB_N block of one shared tile in slot order
    and finishes it; a shared tile held whole by one program (stored already) is skipped. Grid:
    (shared tiles * blocks a tile,)."""
    across: tl.constexpr = BLOCK_N // SUB_N
    blocks: tl.constexpr = (BLOCK_M // SUB_M) * across
    pid = tl.program_id(0)
    shared = pid // blocks
    block = pid % blocks
    k_tiles = tl.cdiv(K, BLOCK_K)
    first = (shared * k_tiles) // span
    parts = ((shared + 1) * k_tiles - 1) // span - first + 1
    if parts > 1:
        pid_m, pid_n = grouped(dp_tiles + shared, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        r0 = (block // across) * SUB_M
        c0 = (block % across) * SUB_N
        at = (r0 + tl.arange(0, SUB_M))[:, None] * BLOCK_N + (c0 + tl.arange(0, SUB_N))[None, :]
        tile_ws = ws_ptr + shared.to(tl.int64) * slots * (BLOCK_M * BLOCK_N)
        acc = tl.zeros((SUB_M, SUB_N), tl.float32)
        for part in range(parts):
            acc += tl.load(tile_ws + part * (BLOCK_M * BLOCK_N) + at)
        finish_tile(
            acc, pid_m * BLOCK_M + r0 + tl.arange(0, SUB_M), pid_n * BLOCK_N + c0 + tl.arange(0, SUB_N),
            0, M, N, 1, out_ptr, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
            alpha, beta, p0, p1, 0, 0, so_m, so_n, 0, 0, sc_m, sc_n, 0, 0, sr_m, sr_n, s_bias,
            HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
        )  # fmt: skip


@triton.jit
def _k_steps(a_desc, b_desc, off_m, off_n, k0, k1, acc, M, N, PRECISION: tl.constexpr, A_T: tl.constexpr,
             B_T: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc`` plus the tile's product over K steps [k0, k1). PRECISION "tf32x3": A and B come as
    TF32 planes (``tf32_planes``: the head's M (N) rows, then the tail's, K-major), and each K
    step's three TF32 products go into a fresh accumulator added to ``acc`` in fp32: Hopper's MMAs
    truncate their running sums, and chained over the whole K loop the error grew with K past the
    FMA units' (H200, 2048 x 512 over K = 16384: 1.3e-4 against 3.3e-6; a step at a time 1.0e-6)."""
    for kt in range(k0, k1):
        off_k = kt * BLOCK_K
        if PRECISION == "tf32x3":
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k]).T
            # The tails' products first, the heads' last: the small terms are summed before the
            # large one joins them.
            part = tl.dot(a_desc.load([M + off_m, off_k]), b, input_precision="tf32")
            part = tl.dot(a, b_desc.load([N + off_n, off_k]).T, part, input_precision="tf32")
            acc += tl.dot(a, b, part, input_precision="tf32")
        else:
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if B_T:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = dot(a, b, acc, PRECISION, False)
    return acc


@triton.jit
def _finish(
    acc, off_m, off_n, out, c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr,
    amax_ptr, alpha, beta, p0, p1, M, N, so_m, so_n, sc_m, sc_n, sr_m, sr_n, s_bias,
    HAS_C: tl.constexpr, BIAS: tl.constexpr, ACT: tl.constexpr, RESIDUAL: tl.constexpr,
    STORE_PRE: tl.constexpr, SCALED: tl.constexpr, AMAX: tl.constexpr, OUT_DESC: tl.constexpr,
    OUT_N: tl.constexpr,
):  # fmt: skip
    """The epilogue of a tile's output columns [off_n, off_n + OUT_N), stored (``out``: the
    output's descriptor where OUT_DESC, else its pointer)."""
    rows = off_m + tl.arange(0, acc.shape[0])
    cols = off_n + tl.arange(0, OUT_N)
    y = epilogue_tile(
        acc, rows, cols, 0, M, N, 1,
        c_ptr, bias_ptr, res_ptr, pre_ptr, scale_a_ptr, scale_b_ptr, amax_ptr,
        alpha, beta, p0, p1,
        0, 0, so_m, so_n, 0, 0, sc_m, sc_n, 0, 0, sr_m, sr_n, s_bias,
        HAS_C, BIAS, ACT, RESIDUAL, STORE_PRE, SCALED, AMAX,
    )  # fmt: skip
    if OUT_DESC:
        out.store([off_m, off_n], convert(y, out.dtype))
    else:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_ptrs = out + rows[:, None] * so_m + cols[None, :] * so_n
        tl.store(out_ptrs, convert(y, out.dtype.element_ty), mask=mask)
