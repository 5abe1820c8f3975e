"""Recurrent kernels: the persistent recurrence (weights resident on chip, or streamed in tiles by
one program or by programs spread over the multiprocessors) and the per-step fallback, forward
and backward through time, with the gate nonlinearities and the cell update fused in.

The input projection ``x W_ih^T + b_ih`` of every step and the weight gradients are large GEMMs
done outside (``ops.matmul``); these kernels do only what must be sequential in time.

Arguments shared by the kernels, documented once. T steps, B batch rows, D directions, H hidden
units, P state width (H, or proj_size for a projected LSTM), NG gates (4 LSTM, 3 GRU, 1 RNN),
G = NG * H. Every tensor is contiguous. Offsets: int64 from the batch rows ``b`` on (x, y, sv,
ht, the gradients, the state slots' columns); int32 for the weights (D * G * P elements) and
the state slots' rows (D * NS * B), which the engines keep below 2**31 (``_int32_reasons``).

* ``x`` (T, B, D, G): the input projection of every step and direction, in torch's gate order.
* ``whh`` (D, G, P), ``bhh`` (D, G), ``whr`` (D, P, H): recurrent weights, bias and projection.
* ``h0`` (D, B, P), ``c0`` (D, B, H); ``lens`` (B,) int32: steps each sequence runs.
* ``y`` (T, B, D, P): the layer output, zero past a sequence's length; ``hn``, ``cn`` as h0, c0.
* ``sv`` (T, B, D, S), fp32 (fp64 for fp64): what the backward pass needs of each step. LSTM:
  the gates i, f, g, o (S = 4H); GRU: r, z, n and ``h W_hn^T + b_hn`` (S = 4H); RNN: h' (S = H).
* ``hbuf`` (D, NS, B, P) in the input dtype, ``cbuf`` (D, NS, B, H) fp32: states by time slot.
  The state before time t of direction d sits in slot ``(t + d) % NS``, the state after it in
  ``(t + 1 - d) % NS``. Saving for the backward pass, NS = T + 1 and slots ``d .. d + T - 1`` line
  up with times 0 .. T - 1 (the weight-gradient GEMM reads them as one matrix); otherwise NS = 2,
  a double buffer.
* ``ht`` (NT, B, D, H): a projected LSTM's unprojected output ``o * tanh(c)``, NT = T when saving,
  else 1 (a scratch row for the projection that follows).
* Backward: ``dy``, ``dhn``, ``dcn`` as y, hn, cn. ``da`` as x: gradients of the gate
  pre-activations (GRU: of the input side ``x W_i*^T + b_i*``). ``dah`` (T, B, D, H), GRU only:
  the gradient of ``h W_hn^T + b_hn``. ``dhs`` as y, projected LSTM only: the gradient of each
  step's output state. ``dh0``, ``dc0`` as h0, c0. ``dhbuf`` (D, 2, B, P) and ``dcbuf`` (D, B, H),
  fp32: the running state gradients of the tiled kernels (a double buffer, and one slot).
* ``sync_ptr`` (tiled kernels): int32 counters, one per (direction, batch block), zeroed.
* Step kernels take ``step``: an int32 tensor whose first element is the step index (a tensor, so
  that the per-step launches go through the launcher's fast path with fixed ints).
* Ints: T, B, H, P, NS.
* Constexprs: CELL (0 LSTM, 1 GRU, 2 RNN tanh, 3 RNN relu), NG, D, HAS_BIAS, PROJ, HAS_LEN,
  SAVE (write sv, ht and every slot for the backward pass); ACC the arithmetic dtype (fp32, fp64
  for fp64); PRECISION, UPCAST as ``ops.matmul``'s dot; BLOCK_B batch rows per program; H_PAD,
  P_PAD (resident kernels: H and P padded to a power of two); BLOCK_H, BLOCK_P, BLOCK_K (tiled:
  tile widths over H, over P, and over the reduction); SPLIT, SYNC, CACHE (tiled kernels:
  programs per batch block and direction, whether they meet on counters, and the cache modifier
  of loads of what other programs wrote).

Step s of direction d is time ``s`` (d = 0) or ``T - 1 - s`` (d = 1) forward, the reverse order
backward. A step past a sequence's length leaves its state and state gradient unchanged, writes
a zero output and zero gate gradients: finished sequences stop, as cuDNN's do.

Numerics: products accumulate in fp32 (fp64 for fp64), fp32 operands multiplied as three TF32
products unless TF32 is allowed (``engines.dot_constexprs``); the state h is rounded to the input
dtype where it feeds the next product (as PyTorch keeps it), the cell state c stays fp32. The
backward pass multiplies gate gradients rounded to the input dtype by the weights (tensor cores
for 16-bit types), accumulating in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...core.numerics import convert, sigmoid, tanh
from ..matmul.kernels import dot

# ---------------------------------------------------------------------------------------------
# Helpers shared by every kernel.


@triton.jit
def _batch(pid, B, BLOCK_B: tl.constexpr):
    b = (pid * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)  # offsets in int64 from here on
    return b, b < B


@triton.jit
def _lengths(len_ptr, b, b_mask, T, HAS_LEN: tl.constexpr):
    if HAS_LEN:
        n = tl.load(len_ptr + b, mask=b_mask, other=0)
    else:
        n = tl.where(b_mask, T, 0)
    return n


@triton.jit
def _time(s, d, T, BACKWARD: tl.constexpr):
    if BACKWARD:
        t = T - 1 - s + d * (2 * s - T + 1)
    else:
        t = s + d * (T - 1 - 2 * s)
    return t


@triton.jit
def _gate_rows(ptr, mask, H, NG: tl.constexpr, ACC: tl.constexpr):
    """The NG gate blocks ``ptr[g * H + j]`` (unused ones repeat the first), in ACC."""
    v0 = convert(tl.load(ptr, mask=mask, other=0.0), ACC)
    v1 = v0
    v2 = v0
    v3 = v0
    if NG > 1:
        v1 = convert(tl.load(ptr + H, mask=mask, other=0.0), ACC)
        v2 = convert(tl.load(ptr + 2 * H, mask=mask, other=0.0), ACC)
    if NG > 3:
        v3 = convert(tl.load(ptr + 3 * H, mask=mask, other=0.0), ACC)
    return v0, v1, v2, v3


@triton.jit
def _biases(bhh_ptr, j, H, NG: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    """The recurrent bias of each gate as (1, len(j)) rows; zeros without bias (nothing read)."""
    if HAS_BIAS:
        mask = j < H
    else:
        mask = j < 0
    b0, b1, b2, b3 = _gate_rows(bhh_ptr + j, mask, H, NG, ACC)
    return b0[None, :], b1[None, :], b2[None, :], b3[None, :]


@triton.jit
def _saved_width(H, CELL: tl.constexpr):
    if CELL <= 1:
        width = 4 * H
    else:
        width = H
    return width


@triton.jit
def _store_saved(sv_ptr, row, j, mask, H, s0, s1, s2, s3, CELL: tl.constexpr):
    ptr = sv_ptr + row[:, None] * _saved_width(H, CELL) + j[None, :]
    tl.store(ptr, s0, mask=mask)
    if CELL <= 1:
        tl.store(ptr + H, s1, mask=mask)
        tl.store(ptr + 2 * H, s2, mask=mask)
        tl.store(ptr + 3 * H, s3, mask=mask)


@triton.jit
def _load_saved(sv_ptr, row, j, mask, H, CELL: tl.constexpr, ACC: tl.constexpr):
    ptr = sv_ptr + row[:, None] * _saved_width(H, CELL) + j[None, :]
    if CELL <= 1:
        s0, s1, s2, s3 = _gate_rows(ptr, mask, H, 4, ACC)
    else:
        s0, s1, s2, s3 = _gate_rows(ptr, mask, H, 1, ACC)
    return s0, s1, s2, s3


@triton.jit
def _cell_forward(a0, a1, a2, a3, x0, x1, x2, x3, c, h, CELL: tl.constexpr):
    """One cell update from the hidden-side (``a*``: h W_hh^T + b_hh) and input-side (``x*``)
    pre-activations of each gate, the cell state ``c`` and the state ``h`` (GRU), all in ACC.
    Returns (h', c', s0, s1, s2, s3): h' unprojected, and the values saved for the backward."""
    if CELL == 0:
        i = sigmoid(x0 + a0)
        f = sigmoid(x1 + a1)
        g = tanh(x2 + a2)
        o = sigmoid(x3 + a3)
        c_new = f * c + i * g
        h_new = o * tanh(c_new)
        s0, s1, s2, s3 = i, f, g, o
    elif CELL == 1:
        r = sigmoid(x0 + a0)
        z = sigmoid(x1 + a1)
        n = tanh(x2 + r * a2)
        h_new = n + z * (h - n)
        c_new = c
        s0, s1, s2, s3 = r, z, n, a2
    else:
        pre = x0 + a0
        if CELL == 2:
            h_new = tanh(pre)
        else:
            h_new = tl.where(pre < 0, 0.0, pre)  # NaN passes, as torch.relu
        c_new = c
        s0, s1, s2, s3 = h_new, h_new, h_new, h_new
    return h_new, c_new, s0, s1, s2, s3


@triton.jit
def _cell_backward(dh, dc, s0, s1, s2, s3, c, c_prev, h_prev, CELL: tl.constexpr):
    """Gate pre-activation gradients from the gradient of the step's unprojected output ``dh`` and
    of its cell state ``dc`` (LSTM). Returns (da0, da1, da2, da3, dc_prev): LSTM i, f, g, o;
    GRU r, z, the input-side n and the hidden-side n; RNN the one gate (repeated)."""
    if CELL == 0:
        i, f, g, o = s0, s1, s2, s3
        tc = tanh(c)
        dc = dc + dh * o * (1.0 - tc * tc)
        da0 = dc * g * i * (1.0 - i)
        da1 = dc * c_prev * f * (1.0 - f)
        da2 = dc * i * (1.0 - g * g)
        da3 = dh * tc * o * (1.0 - o)
        dc_prev = dc * f
    elif CELL == 1:
        r, z, n, hn = s0, s1, s2, s3
        dn = dh * (1.0 - z) * (1.0 - n * n)
        da0 = dn * hn * r * (1.0 - r)
        da1 = dh * (h_prev - n) * z * (1.0 - z)
        da2 = dn
        da3 = dn * r
        dc_prev = dc
    else:
        if CELL == 2:
            da0 = dh * (1.0 - s0 * s0)
        else:
            da0 = tl.where(s0 > 0, dh, 0.0)
        da1, da2, da3 = da0, da0, da0
        dc_prev = dc
    return da0, da1, da2, da3, dc_prev


# ---------------------------------------------------------------------------------------------
# Resident: one program per (batch block, direction) runs every step with W_hh (and W_hr) loaded
# once into registers / shared memory, h and c in registers: no global round trip per step.


@triton.jit
def _forward_resident_kernel(
    x_ptr, whh_ptr, bhh_ptr, whr_ptr, h0_ptr, c0_ptr, len_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr,
    cbuf_ptr, ht_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, PROJ: tl.constexpr,
    HAS_LEN: tl.constexpr, SAVE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, H_PAD: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    d = tl.program_id(1)
    b, b_mask = _batch(tl.program_id(0), B, BLOCK_B)
    DT = y_ptr.dtype.element_ty
    G = NG * H
    j = tl.arange(0, H_PAD)
    k = tl.arange(0, P_PAD)
    hm = b_mask[:, None] & (j < H)[None, :]
    pm = b_mask[:, None] & (k < P)[None, :]
    # W_hh^T of each gate, (P_PAD, H_PAD): [k, j] = W_hh[d, g * H + j, k].
    wt = whh_ptr + d * G * P + j[None, :] * P + k[:, None]
    w0, w1, w2, w3 = _gate_rows(wt, (k < P)[:, None] & (j < H)[None, :], H * P, NG, whh_ptr.dtype.element_ty)
    b0, b1, b2, b3 = _biases(bhh_ptr + d * G, j, H, NG, HAS_BIAS, ACC)
    wr = w0
    if PROJ:  # W_hr^T, (H_PAD, P_PAD): [j, k] = W_hr[d, k, j]
        wr = tl.load(
            whr_ptr + d * P * H + k[None, :] * H + j[:, None],
            mask=(j < H)[:, None] & (k < P)[None, :],
            other=0.0,
        )
    h = tl.load(h0_ptr + (d * B + b[:, None]) * P + k[None, :], mask=pm, other=0.0)
    c = tl.zeros([BLOCK_B, H_PAD], ACC)
    if CELL == 0:
        c = convert(tl.load(c0_ptr + (d * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0), ACC)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    for s in range(T):
        t = _time(s, d, T, False)
        active = (t < n)[:, None]
        row = (t * B + b) * D + d
        if SAVE:  # the state before time t, for the backward pass
            slot = (d * NS + t + d) * B + b[:, None]
            tl.store(hbuf_ptr + slot * P + k[None, :], h, mask=pm)
            if CELL == 0:
                tl.store(cbuf_ptr + slot * H + j[None, :], c, mask=hm)
        zero = tl.zeros([BLOCK_B, H_PAD], ACC)
        a0 = dot(h, w0, zero, PRECISION, UPCAST) + b0
        a1 = a0
        a2 = a0
        a3 = a0
        if NG > 1:
            a1 = dot(h, w1, zero, PRECISION, UPCAST) + b1
            a2 = dot(h, w2, zero, PRECISION, UPCAST) + b2
        if NG > 3:
            a3 = dot(h, w3, zero, PRECISION, UPCAST) + b3
        x0, x1, x2, x3 = _gate_rows(x_ptr + row[:, None] * G + j[None, :], hm, H, NG, ACC)
        out, c_new, s0, s1, s2, s3 = _cell_forward(a0, a1, a2, a3, x0, x1, x2, x3, c, convert(h, ACC), CELL)
        if SAVE:
            _store_saved(sv_ptr, row, j, hm, H, s0, s1, s2, s3, CELL)
        if PROJ:
            out_dt = convert(out, DT)
            if SAVE:
                tl.store(ht_ptr + row[:, None] * H + j[None, :], out_dt, mask=hm)
            out = dot(out_dt, wr, tl.zeros([BLOCK_B, P_PAD], ACC), PRECISION, UPCAST)
        h = tl.where(active, convert(out, DT), h)
        c = tl.where(active, c_new, c)
        tl.store(y_ptr + row[:, None] * P + k[None, :], convert(tl.where(active, out, 0.0), DT), mask=pm)
    tl.store(hn_ptr + (d * B + b[:, None]) * P + k[None, :], h, mask=pm)
    if CELL == 0:
        tl.store(cn_ptr + (d * B + b[:, None]) * H + j[None, :], convert(c, DT), mask=hm)
    if SAVE:
        slot = (d * NS + (1 - d) * T) * B + b[:, None]
        tl.store(hbuf_ptr + slot * P + k[None, :], h, mask=pm)
        if CELL == 0:
            tl.store(cbuf_ptr + slot * H + j[None, :], c, mask=hm)


@triton.jit
def _backward_resident_kernel(
    dy_ptr, dhn_ptr, dcn_ptr, whh_ptr, whr_ptr, len_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr, da_ptr, dah_ptr,
    dhs_ptr, dh0_ptr, dc0_ptr, dhbuf_ptr, dcbuf_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, PROJ: tl.constexpr, HAS_LEN: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, H_PAD: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    d = tl.program_id(1)
    b, b_mask = _batch(tl.program_id(0), B, BLOCK_B)
    DT = da_ptr.dtype.element_ty
    G = NG * H
    j = tl.arange(0, H_PAD)
    k = tl.arange(0, P_PAD)
    hm = b_mask[:, None] & (j < H)[None, :]
    pm = b_mask[:, None] & (k < P)[None, :]
    # W_hh of each gate, (H_PAD, P_PAD): [j, k] = W_hh[d, g * H + j, k].
    wp = whh_ptr + d * G * P + j[:, None] * P + k[None, :]
    w0, w1, w2, w3 = _gate_rows(wp, (j < H)[:, None] & (k < P)[None, :], H * P, NG, whh_ptr.dtype.element_ty)
    wr = w0
    if PROJ:  # W_hr, (P_PAD, H_PAD)
        wr = tl.load(
            whr_ptr + d * P * H + k[:, None] * H + j[None, :],
            mask=(k < P)[:, None] & (j < H)[None, :],
            other=0.0,
        )
    dh = convert(tl.load(dhn_ptr + (d * B + b[:, None]) * P + k[None, :], mask=pm, other=0.0), ACC)
    dc = tl.zeros([BLOCK_B, H_PAD], ACC)
    if CELL == 0:
        dc = convert(tl.load(dcn_ptr + (d * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0), ACC)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    for s in range(T):
        t = _time(s, d, T, True)
        active = (t < n)[:, None]
        row = (t * B + b) * D + d
        dy = convert(tl.load(dy_ptr + row[:, None] * P + k[None, :], mask=pm, other=0.0), ACC)
        dh = dh + tl.where(active, dy, 0.0)
        dht = dh
        if PROJ:
            tl.store(dhs_ptr + row[:, None] * P + k[None, :], convert(tl.where(active, dh, 0.0), DT), mask=pm)
            dht = dot(convert(dh, DT), wr, tl.zeros([BLOCK_B, H_PAD], ACC), PRECISION, UPCAST)
        s0, s1, s2, s3 = _load_saved(sv_ptr, row, j, hm, H, CELL, ACC)
        c_t = dc
        c_prev = dc
        h_prev = dc
        if CELL == 0:
            c_t = tl.load(
                cbuf_ptr + ((d * NS + t + 1 - d) * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0
            )
            c_prev = tl.load(
                cbuf_ptr + ((d * NS + t + d) * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0
            )
        if CELL == 1:
            h_prev = tl.load(
                hbuf_ptr + ((d * NS + t + d) * B + b[:, None]) * P + j[None, :], mask=hm, other=0.0
            )
            h_prev = convert(h_prev, ACC)
        da0, da1, da2, da3, dc_prev = _cell_backward(dht, dc, s0, s1, s2, s3, c_t, c_prev, h_prev, CELL)
        da0 = convert(tl.where(active, da0, 0.0), DT)
        da1 = convert(tl.where(active, da1, 0.0), DT)
        da2 = convert(tl.where(active, da2, 0.0), DT)
        da3 = convert(tl.where(active, da3, 0.0), DT)
        _store_gates(da_ptr, dah_ptr, row, j, hm, H, da0, da1, da2, da3, CELL, NG)
        zero = tl.zeros([BLOCK_B, P_PAD], ACC)
        acc = dot(da0, w0, zero, PRECISION, UPCAST)
        if NG > 1:
            acc = dot(da1, w1, acc, PRECISION, UPCAST)
            if CELL == 1:
                acc = dot(da3, w2, acc, PRECISION, UPCAST)  # the hidden side of the n gate
            else:
                acc = dot(da2, w2, acc, PRECISION, UPCAST)
        if NG > 3:
            acc = dot(da3, w3, acc, PRECISION, UPCAST)
        if CELL == 1:
            acc += dh * s1  # h' = ... + z h
        dh = tl.where(active, acc, dh)
        dc = tl.where(active, dc_prev, dc)
    tl.store(dh0_ptr + (d * B + b[:, None]) * P + k[None, :], convert(dh, DT), mask=pm)
    if CELL == 0:
        tl.store(dc0_ptr + (d * B + b[:, None]) * H + j[None, :], convert(dc, DT), mask=hm)


@triton.jit
def _store_gates(da_ptr, dah_ptr, row, j, mask, H, da0, da1, da2, da3, CELL: tl.constexpr, NG: tl.constexpr):
    ptr = da_ptr + row[:, None] * (NG * H) + j[None, :]
    tl.store(ptr, da0, mask=mask)
    if NG > 1:
        tl.store(ptr + H, da1, mask=mask)
        tl.store(ptr + 2 * H, da2, mask=mask)
    if NG > 3:
        tl.store(ptr + 3 * H, da3, mask=mask)
    if CELL == 1:
        tl.store(dah_ptr + row[:, None] * H + j[None, :], da3, mask=mask)


# ---------------------------------------------------------------------------------------------
# Tiles: one step of one batch block over a tile of hidden units (or of state columns), the
# weights streamed from cache. The persistent tiled kernels loop over steps and tiles in programs
# per (batch block, direction); the step kernels run one tile per program, one launch per step.


@triton.jit
def _forward_tile(
    x_ptr, whh_ptr, bhh_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr,
    s, jt, d, b, b_mask, n, T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, PROJ: tl.constexpr,
    SAVE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
    GATHER: tl.constexpr,
):  # fmt: skip
    """Gates and cell update of hidden units ``jt * BLOCK_H ...`` at step s: reads the state slot
    of time t, writes the next slot (projected: o * tanh(c) into ht, for ``_project_tile``).
    ``CACHE``: the load cache modifier of what other programs wrote (the whole state).
    ``GATHER``: the gates' weight rows of the tile gathered into one (4 * BLOCK_H)-wide product
    (a fourth gate of zeros for a GRU), then split into gates: one 64-wide product for a tile of
    16 units ran twice as fast as four 16-wide ones, and such tiles spread the weights over
    enough programs for each one's slice to stay in its cache."""
    t = _time(s, d, T, False)
    active = (t < n)[:, None]
    DT = y_ptr.dtype.element_ty
    G = NG * H
    j = jt * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = b_mask[:, None] & (j < H)[None, :]
    read = (d * NS + (t + d) % NS) * B + b
    write = (d * NS + (t + 1 - d) % NS) * B + b
    zero = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    # What does not depend on the state first: its loads are in flight during the products.
    b0, b1, b2, b3 = _biases(bhh_ptr + d * G, j, H, NG, HAS_BIAS, ACC)
    row = (t * B + b) * D + d
    x0, x1, x2, x3 = _gate_rows(x_ptr + row[:, None] * G + j[None, :], hm, H, NG, ACC)
    c = zero
    if CELL == 0:
        c = tl.load(cbuf_ptr + read[:, None] * H + j[None, :], mask=hm, other=0.0)
    h_old = convert(zero, DT)
    if not PROJ:  # P == H: this tile's columns of the state
        h_old = tl.load(hbuf_ptr + read[:, None] * P + j[None, :], mask=hm, other=0.0)
    a0, a1, a2, a3 = zero, zero, zero, zero
    # GATHER: column r of the product is gate r // BLOCK_H of unit r % BLOCK_H of the tile.
    r = tl.arange(0, 4 * BLOCK_H)
    unit = jt * BLOCK_H + r % BLOCK_H
    gathered = (d * G + (r // BLOCK_H) * H + unit) * P
    acc = tl.zeros([BLOCK_B, 4 * BLOCK_H], ACC)
    for k0 in range(0, P, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        hk = tl.load(
            hbuf_ptr + read[:, None] * P + k[None, :],
            mask=b_mask[:, None] & (k < P)[None, :],
            other=0.0,
            cache_modifier=CACHE,
        )
        if GATHER:
            wm = (k < P)[:, None] & ((r // BLOCK_H < NG) & (unit < H))[None, :]
            w = tl.load(whh_ptr + gathered[None, :] + k[:, None], mask=wm, other=0.0)
            acc = dot(hk, w, acc, PRECISION, UPCAST)
        else:
            wt = whh_ptr + (d * G + j[None, :]) * P + k[:, None]
            wm = (k < P)[:, None] & (j < H)[None, :]
            a0 = dot(hk, tl.load(wt, mask=wm, other=0.0), a0, PRECISION, UPCAST)
            if NG > 1:
                a1 = dot(hk, tl.load(wt + H * P, mask=wm, other=0.0), a1, PRECISION, UPCAST)
                a2 = dot(hk, tl.load(wt + 2 * H * P, mask=wm, other=0.0), a2, PRECISION, UPCAST)
            if NG > 3:
                a3 = dot(hk, tl.load(wt + 3 * H * P, mask=wm, other=0.0), a3, PRECISION, UPCAST)
    if GATHER:  # columns g * BLOCK_H + u, g = 2 * g1 + g0: split g0, then g1
        by_gate = tl.permute(tl.reshape(acc, (BLOCK_B, 2, 2, BLOCK_H)), (0, 3, 1, 2))
        even, odd = tl.split(by_gate)
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
    out, c_new, s0, s1, s2, s3 = _cell_forward(
        a0 + b0, a1 + b1, a2 + b2, a3 + b3, x0, x1, x2, x3, c, convert(h_old, ACC), CELL
    )
    if SAVE:
        _store_saved(sv_ptr, row, j, hm, H, s0, s1, s2, s3, CELL)
    if CELL == 0:
        c_new = tl.where(active, c_new, c)
        tl.store(cbuf_ptr + write[:, None] * H + j[None, :], c_new, mask=hm)
        if s == T - 1:
            tl.store(cn_ptr + (d * B + b[:, None]) * H + j[None, :], convert(c_new, DT), mask=hm)
    if PROJ:
        if SAVE:
            ht_row = row
        else:  # one scratch row
            ht_row = b * D + d
        tl.store(ht_ptr + ht_row[:, None] * H + j[None, :], convert(out, DT), mask=hm)
    else:
        h_new = tl.where(active, convert(out, DT), h_old)
        tl.store(hbuf_ptr + write[:, None] * P + j[None, :], h_new, mask=hm)
        tl.store(y_ptr + row[:, None] * P + j[None, :], convert(tl.where(active, out, 0.0), DT), mask=hm)
        if s == T - 1:
            tl.store(hn_ptr + (d * B + b[:, None]) * P + j[None, :], h_new, mask=hm)


@triton.jit
def _project_tile(
    whr_ptr, y_ptr, hn_ptr, hbuf_ptr, ht_ptr,
    s, pt, d, b, b_mask, n, T, B, H, P, NS,
    D: tl.constexpr, SAVE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """State columns ``pt * BLOCK_P ...`` of a projected LSTM at step s: (o * tanh(c)) W_hr^T."""
    t = _time(s, d, T, False)
    active = (t < n)[:, None]
    DT = y_ptr.dtype.element_ty
    k = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = b_mask[:, None] & (k < P)[None, :]
    row = (t * B + b) * D + d
    if SAVE:
        ht_row = row
    else:
        ht_row = b * D + d
    acc = tl.zeros([BLOCK_B, BLOCK_P], ACC)
    for j0 in range(0, H, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        hk = tl.load(
            ht_ptr + ht_row[:, None] * H + j[None, :],
            mask=b_mask[:, None] & (j < H)[None, :],
            other=0.0,
            cache_modifier=CACHE,
        )
        w = tl.load(
            whr_ptr + d * P * H + k[None, :] * H + j[:, None],
            mask=(j < H)[:, None] & (k < P)[None, :],
            other=0.0,
        )
        acc = dot(hk, w, acc, PRECISION, UPCAST)
    read = (d * NS + (t + d) % NS) * B + b
    write = (d * NS + (t + 1 - d) % NS) * B + b
    h_new = tl.where(
        active, convert(acc, DT), tl.load(hbuf_ptr + read[:, None] * P + k[None, :], mask=pm, other=0.0)
    )
    tl.store(hbuf_ptr + write[:, None] * P + k[None, :], h_new, mask=pm)
    tl.store(y_ptr + row[:, None] * P + k[None, :], convert(tl.where(active, acc, 0.0), DT), mask=pm)
    if s == T - 1:
        tl.store(hn_ptr + (d * B + b[:, None]) * P + k[None, :], h_new, mask=pm)


@triton.jit
def _grad_gates_tile(
    dy_ptr, whr_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, da_ptr, dah_ptr, dhs_ptr, dc0_ptr, dhbuf_ptr, dcbuf_ptr,
    s, jt, d, b, b_mask, n, T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, PROJ: tl.constexpr, ACC: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """Backward step s, phase 1: gate gradients of hidden units ``jt * BLOCK_H ...`` from the
    running state gradient (slot s % 2 of dhbuf) plus dy, and the cell-state gradient."""
    t = _time(s, d, T, True)
    active = (t < n)[:, None]
    DT = da_ptr.dtype.element_ty
    j = jt * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = b_mask[:, None] & (j < H)[None, :]
    row = (t * B + b) * D + d
    grad = (d * 2 + s % 2) * B + b
    if PROJ:  # the gradient of o * tanh(c) is dh W_hr, over every state column
        dht = tl.zeros([BLOCK_B, BLOCK_H], ACC)
        for k0 in range(0, P, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            pm = b_mask[:, None] & (k < P)[None, :]
            dy = convert(tl.load(dy_ptr + row[:, None] * P + k[None, :], mask=pm, other=0.0), ACC)
            dh = tl.load(
                dhbuf_ptr + grad[:, None] * P + k[None, :], mask=pm, other=0.0, cache_modifier=CACHE
            ) + tl.where(active, dy, 0.0)
            if jt == 0:
                tl.store(
                    dhs_ptr + row[:, None] * P + k[None, :], convert(tl.where(active, dh, 0.0), DT), mask=pm
                )
            w = tl.load(
                whr_ptr + d * P * H + k[:, None] * H + j[None, :],
                mask=(k < P)[:, None] & (j < H)[None, :],
                other=0.0,
            )
            dht = dot(convert(dh, DT), w, dht, PRECISION, UPCAST)
    else:
        dy = convert(tl.load(dy_ptr + row[:, None] * P + j[None, :], mask=hm, other=0.0), ACC)
        dht = tl.load(dhbuf_ptr + grad[:, None] * P + j[None, :], mask=hm, other=0.0) + tl.where(
            active, dy, 0.0
        )
    s0, s1, s2, s3 = _load_saved(sv_ptr, row, j, hm, H, CELL, ACC)
    dc = tl.zeros([BLOCK_B, BLOCK_H], ACC)
    c_t = dc
    c_prev = dc
    h_prev = dc
    if CELL == 0:
        dc = tl.load(dcbuf_ptr + (d * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0)
        c_t = tl.load(cbuf_ptr + ((d * NS + t + 1 - d) * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0)
        c_prev = tl.load(cbuf_ptr + ((d * NS + t + d) * B + b[:, None]) * H + j[None, :], mask=hm, other=0.0)
    if CELL == 1:
        h_prev = tl.load(hbuf_ptr + ((d * NS + t + d) * B + b[:, None]) * P + j[None, :], mask=hm, other=0.0)
        h_prev = convert(h_prev, ACC)
    da0, da1, da2, da3, dc_prev = _cell_backward(dht, dc, s0, s1, s2, s3, c_t, c_prev, h_prev, CELL)
    da0 = convert(tl.where(active, da0, 0.0), DT)
    da1 = convert(tl.where(active, da1, 0.0), DT)
    da2 = convert(tl.where(active, da2, 0.0), DT)
    da3 = convert(tl.where(active, da3, 0.0), DT)
    _store_gates(da_ptr, dah_ptr, row, j, hm, H, da0, da1, da2, da3, CELL, NG)
    if CELL == 0:
        dc = tl.where(active, dc_prev, dc)
        tl.store(dcbuf_ptr + (d * B + b[:, None]) * H + j[None, :], dc, mask=hm)
        if s == T - 1:
            tl.store(dc0_ptr + (d * B + b[:, None]) * H + j[None, :], convert(dc, DT), mask=hm)


@triton.jit
def _grad_state_tile(
    dy_ptr, whh_ptr, sv_ptr, da_ptr, dah_ptr, dh0_ptr, dhbuf_ptr,
    s, pt, d, b, b_mask, n, T, B, H, P,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    CACHE: tl.constexpr,
):  # fmt: skip
    """Backward step s, phase 2: state columns ``pt * BLOCK_P ...`` of the gradient passed to the
    previous step, ``da @ W_hh`` (GRU: + dh * z), into slot (s + 1) % 2 of dhbuf."""
    t = _time(s, d, T, True)
    active = (t < n)[:, None]
    DT = da_ptr.dtype.element_ty
    G = NG * H
    k = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    pm = b_mask[:, None] & (k < P)[None, :]
    row = (t * B + b) * D + d
    # What the products do not change first: its loads are in flight during them.
    dy = convert(tl.load(dy_ptr + row[:, None] * P + k[None, :], mask=pm, other=0.0), ACC)
    read = (d * 2 + s % 2) * B + b
    dh = tl.load(dhbuf_ptr + read[:, None] * P + k[None, :], mask=pm, other=0.0) + tl.where(active, dy, 0.0)
    z = dh
    if CELL == 1:  # P == H: z of these columns
        z = convert(tl.load(sv_ptr + row[:, None] * (4 * H) + H + k[None, :], mask=pm, other=0.0), ACC)
    acc = tl.zeros([BLOCK_B, BLOCK_P], ACC)
    for j0 in range(0, H, BLOCK_K):  # the gates inside: one pipelined loop, NG loads in flight
        j = j0 + tl.arange(0, BLOCK_K)
        am = b_mask[:, None] & (j < H)[None, :]
        for g in tl.static_range(NG):
            if CELL == 1 and g == 2:
                da = tl.load(
                    dah_ptr + row[:, None] * H + j[None, :], mask=am, other=0.0, cache_modifier=CACHE
                )
            else:
                da = tl.load(
                    da_ptr + row[:, None] * G + g * H + j[None, :], mask=am, other=0.0, cache_modifier=CACHE
                )
            w = tl.load(
                whh_ptr + (d * G + g * H + j[:, None]) * P + k[None, :],
                mask=(j < H)[:, None] & (k < P)[None, :],
                other=0.0,
            )
            acc = dot(da, w, acc, PRECISION, UPCAST)
    if CELL == 1:  # h' = ... + z h
        acc += dh * z
    dh = tl.where(active, acc, dh)
    write = (d * 2 + (s + 1) % 2) * B + b
    tl.store(dhbuf_ptr + write[:, None] * P + k[None, :], dh, mask=pm)
    if s == T - 1:
        tl.store(dh0_ptr + (d * B + b[:, None]) * P + k[None, :], convert(dh, DT), mask=pm)


# ---------------------------------------------------------------------------------------------
# Tiled persistent kernels: grid (SPLIT, batch blocks, directions); the SPLIT programs of a batch
# block and direction share its hidden tiles (tile ``part``, ``part + SPLIT``, ...) and loop over
# the steps together. With SPLIT = 1 a program owns all of H for its rows and a phase ends with its
# own barrier. With SYNC, a phase ends on the group's counter (cuDNN's persistent algorithm spread
# over multiprocessors): every program of the group must be resident at once, which the engine
# ensures by launching no more programs than multiprocessors; and what other programs wrote is
# read with CACHE = ".cg" (from L2: L1 is not coherent across multiprocessors).


@triton.jit
def _phase_done(counter_ptr, arrivals, SYNC: tl.constexpr):
    """Returns once every program of the group has finished the phase: with SYNC, when the group's
    counter reaches ``arrivals`` (its programs times the phases done so far, this one included);
    without, when this program's threads have (a program that owns all of H)."""
    tl.debug_barrier()  # every thread's writes of the phase are issued before the program arrives
    if SYNC:
        # The arrival's own count tells the last program to arrive (the one the others wait for)
        # that it need not poll: one round trip to L2 less on each phase's critical path.
        seen = tl.atomic_add(counter_ptr, 1, sem="acq_rel") + 1
        while seen < arrivals:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        tl.debug_barrier()


@triton.jit
def _forward_tiled_kernel(
    x_ptr, whh_ptr, bhh_ptr, whr_ptr, h0_ptr, c0_ptr, len_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr,
    cbuf_ptr, ht_ptr, sync_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, PROJ: tl.constexpr,
    HAS_LEN: tl.constexpr, SAVE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SYNC: tl.constexpr, CACHE: tl.constexpr,
    GATHER: tl.constexpr,
):  # fmt: skip
    """``sync_ptr`` (D, batch blocks) int32 zeros: the groups' counters (with SYNC); ``GATHER`` as
    ``_forward_tile``'s."""
    part = tl.program_id(0)
    d = tl.program_id(2)
    b, b_mask = _batch(tl.program_id(1), B, BLOCK_B)
    counter = sync_ptr + d * tl.num_programs(1) + tl.program_id(1)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    arrived = 0
    for s in range(T):
        for jt in range(part, tl.cdiv(H, BLOCK_H), SPLIT):
            _forward_tile(
                x_ptr, whh_ptr, bhh_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr,
                s, jt, d, b, b_mask, n, T, B, H, P, NS,
                CELL, NG, D, HAS_BIAS, PROJ, SAVE, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_H, BLOCK_K, CACHE,
                GATHER,
            )  # fmt: skip
        arrived += SPLIT
        _phase_done(counter, arrived, SYNC)  # the new state (or ht) is written before any is read
        if PROJ:
            for pt in range(part, tl.cdiv(P, BLOCK_P), SPLIT):
                _project_tile(
                    whr_ptr, y_ptr, hn_ptr, hbuf_ptr, ht_ptr, s, pt, d, b, b_mask, n, T, B, H, P, NS,
                    D, SAVE, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_P, BLOCK_K, CACHE,
                )  # fmt: skip
            arrived += SPLIT
            _phase_done(counter, arrived, SYNC)


@triton.jit
def _backward_tiled_kernel(
    dy_ptr, dhn_ptr, dcn_ptr, whh_ptr, whr_ptr, len_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr, da_ptr, dah_ptr,
    dhs_ptr, dh0_ptr, dc0_ptr, dhbuf_ptr, dcbuf_ptr, sync_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, PROJ: tl.constexpr, HAS_LEN: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SYNC: tl.constexpr, CACHE: tl.constexpr,
):  # fmt: skip
    """As the forward. Unprojected, BLOCK_P == BLOCK_H: a program's state-gradient tiles (phase 2)
    are the columns its gate tiles (phase 1 of the next step) read, so only phase 1 ends on the
    group's counter."""
    part = tl.program_id(0)
    d = tl.program_id(2)
    b, b_mask = _batch(tl.program_id(1), B, BLOCK_B)
    counter = sync_ptr + d * tl.num_programs(1) + tl.program_id(1)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    arrived = 0
    for s in range(T):
        for jt in range(part, tl.cdiv(H, BLOCK_H), SPLIT):
            _grad_gates_tile(
                dy_ptr, whr_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, da_ptr, dah_ptr, dhs_ptr, dc0_ptr, dhbuf_ptr,
                dcbuf_ptr, s, jt, d, b, b_mask, n, T, B, H, P, NS,
                CELL, NG, D, PROJ, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_H, BLOCK_K, CACHE,
            )  # fmt: skip
        arrived += SPLIT
        _phase_done(counter, arrived, SYNC)  # every gate gradient of the step is written before phase 2
        for pt in range(part, tl.cdiv(P, BLOCK_P), SPLIT):
            _grad_state_tile(
                dy_ptr, whh_ptr, sv_ptr, da_ptr, dah_ptr, dh0_ptr, dhbuf_ptr, s, pt, d, b, b_mask, n,
                T, B, H, P, CELL, NG, D, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_P, BLOCK_K, CACHE,
            )  # fmt: skip
        if PROJ:
            arrived += SPLIT
            _phase_done(counter, arrived, SYNC)
        else:
            tl.debug_barrier()


@triton.jit
def _state_gradient_sum(
    part_ptr, dhbuf_ptr, slot, d, b, j, hm, B, P, NT, CACHE: tl.constexpr, BLOCK_Q: tl.constexpr
):
    """Columns j of the state gradient a step passes back: the owned kernel's partial products of
    every unit tile (slot ``slot`` of part), added in tile order, plus what this program left
    for its own columns in dhbuf (the gradient of sequences that have stopped, GRU's dh * z)."""
    acc = tl.load(dhbuf_ptr + ((d * 2 + slot) * B + b[:, None]) * P + j[None, :], mask=hm, other=0.0)
    for q0 in range(0, NT, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        rows = ((d * 2 + slot) * NT + q[:, None, None]).to(tl.int64) * B + b[None, :, None]
        block = tl.load(
            part_ptr + rows * P + j[None, None, :],
            mask=(q < NT)[:, None, None] & hm[None, :, :],
            other=0.0,
            cache_modifier=CACHE,
        )
        acc += tl.sum(block, axis=0)
    return acc


@triton.jit
def _backward_owned_kernel(
    dy_ptr, dhn_ptr, dcn_ptr, whh_ptr, whr_ptr, len_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr, da_ptr, dah_ptr,
    dhs_ptr, dh0_ptr, dc0_ptr, dhbuf_ptr, dcbuf_ptr, sync_ptr, part_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, PROJ: tl.constexpr, HAS_LEN: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SYNC: tl.constexpr, CACHE: tl.constexpr, BLOCK_Q: tl.constexpr,
):  # fmt: skip
    """The tiled backward of a gated cell without projection, one phase a step: a program owns
    unit tiles; it computes their gate gradients, then right away their share of the state
    gradient the previous step needs, ``da[:, tile's gates] @ W_hh[tile's gate rows, :]`` (one
    product with the tile's gates gathered, its weight rows read by this program only, so they
    stay in its cache), into its slot of ``part_ptr`` (D, 2, NT, B, P) fp32, NT = cdiv(H,
    BLOCK_H), whose slot 0 is zeros. After the step's meeting, the next step's owners add the NT
    shares of their columns in tile order (deterministic). The two-phase kernel instead has every
    program read all of a step's gate gradients and a (4H x BLOCK_P) slice of the weights."""
    part = tl.program_id(0)
    d = tl.program_id(2)
    b, b_mask = _batch(tl.program_id(1), B, BLOCK_B)
    counter = sync_ptr + d * tl.num_programs(1) + tl.program_id(1)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    DT = da_ptr.dtype.element_ty
    G = NG * H
    NT = tl.cdiv(H, BLOCK_H)
    r = tl.arange(0, 4 * BLOCK_H)  # gathered rows: gate r // BLOCK_H of unit r % BLOCK_H
    arrived = 0
    for s in range(T):
        slot = s % 2
        t = _time(s, d, T, True)
        active = (t < n)[:, None]
        row = (t * B + b) * D + d
        for jt in range(part, NT, SPLIT):
            j = jt * BLOCK_H + tl.arange(0, BLOCK_H)
            hm = b_mask[:, None] & (j < H)[None, :]
            own = ((d * 2 + slot) * B + b[:, None]) * P + j[None, :]
            dh = _state_gradient_sum(part_ptr, dhbuf_ptr, slot, d, b, j, hm, B, P, NT, CACHE, BLOCK_Q)
            tl.store(dhbuf_ptr + own, dh, mask=hm)
            tl.debug_barrier()
            _grad_gates_tile(
                dy_ptr, whr_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, da_ptr, dah_ptr, dhs_ptr, dc0_ptr, dhbuf_ptr,
                dcbuf_ptr, s, jt, d, b, b_mask, n, T, B, H, P, NS,
                CELL, NG, D, PROJ, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_H, BLOCK_K, "",
            )  # fmt: skip
            tl.debug_barrier()
            # What passes to the previous step outside the product: a stopped sequence's whole
            # gradient, GRU's dh * z.
            dh += tl.where(
                active, convert(tl.load(dy_ptr + row[:, None] * P + j[None, :], mask=hm, other=0.0), ACC), 0.0
            )
            rest = tl.where(active, 0.0, dh)
            if CELL == 1:
                z = tl.load(sv_ptr + row[:, None] * (4 * H) + H + j[None, :], mask=hm, other=0.0)
                rest = tl.where(active, dh * convert(z, ACC), dh)
            tl.store(dhbuf_ptr + ((d * 2 + 1 - slot) * B + b[:, None]) * P + j[None, :], rest, mask=hm)
            # This tile's gate gradients, gathered (GRU: r, z and the hidden-side n), by its rows.
            gate = r // BLOCK_H
            unit = jt * BLOCK_H + r % BLOCK_H
            used = (gate < NG) & (unit < H)
            am = b_mask[:, None] & used[None, :]
            if CELL == 1:
                on_h = gate == 2
                da = tl.load(
                    da_ptr + row[:, None] * G + (gate * H + unit)[None, :],
                    mask=am & ~on_h[None, :],
                    other=0.0,
                )
                da += tl.load(dah_ptr + row[:, None] * H + unit[None, :], mask=am & on_h[None, :], other=0.0)
            else:
                da = tl.load(da_ptr + row[:, None] * G + (gate * H + unit)[None, :], mask=am, other=0.0)
            out = ((d * 2 + 1 - slot) * NT + jt).to(tl.int64) * B + b
            for p0 in range(0, P, BLOCK_P):
                k = p0 + tl.arange(0, BLOCK_P)
                w = tl.load(
                    whh_ptr + (d * G + gate * H + unit)[:, None] * P + k[None, :],
                    mask=used[:, None] & (k < P)[None, :],
                    other=0.0,
                )
                share = dot(da, w, tl.zeros([BLOCK_B, BLOCK_P], ACC), PRECISION, UPCAST)
                tl.store(
                    part_ptr + out[:, None] * P + k[None, :], share, mask=b_mask[:, None] & (k < P)[None, :]
                )
        arrived += SPLIT
        _phase_done(counter, arrived, SYNC)  # every share of the step is written before any is read
    for jt in range(part, NT, SPLIT):
        j = jt * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = b_mask[:, None] & (j < H)[None, :]
        dh = _state_gradient_sum(part_ptr, dhbuf_ptr, T % 2, d, b, j, hm, B, P, NT, CACHE, BLOCK_Q)
        tl.store(dh0_ptr + (d * B + b[:, None]) * P + j[None, :], convert(dh, DT), mask=hm)


# ---------------------------------------------------------------------------------------------
# Step kernels: grid (tiles, batch blocks, directions), one launch per step (and phase). More
# programs than the persistent kernels for a large H, at a launch per step.


@triton.jit
def _forward_step_kernel(
    x_ptr, whh_ptr, bhh_ptr, whr_ptr, h0_ptr, c0_ptr, len_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr,
    cbuf_ptr, ht_ptr, step_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr, PROJ: tl.constexpr,
    HAS_LEN: tl.constexpr, SAVE: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr, PHASE: tl.constexpr,
):  # fmt: skip
    """PHASE 0: the gates of hidden tile program_id(0); PHASE 1: the projection's state tile."""
    s = tl.load(step_ptr)
    d = tl.program_id(2)
    b, b_mask = _batch(tl.program_id(1), B, BLOCK_B)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    if PHASE == 0:
        _forward_tile(
            x_ptr, whh_ptr, bhh_ptr, y_ptr, hn_ptr, cn_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr,
            s, tl.program_id(0), d, b, b_mask, n, T, B, H, P, NS,
            CELL, NG, D, HAS_BIAS, PROJ, SAVE, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_H, BLOCK_K, "", False,
        )  # fmt: skip
    else:
        _project_tile(
            whr_ptr, y_ptr, hn_ptr, hbuf_ptr, ht_ptr, s, tl.program_id(0), d, b, b_mask, n, T, B, H, P, NS,
            D, SAVE, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_P, BLOCK_K, "",
        )  # fmt: skip


@triton.jit
def _backward_step_kernel(
    dy_ptr, dhn_ptr, dcn_ptr, whh_ptr, whr_ptr, len_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, ht_ptr, da_ptr, dah_ptr,
    dhs_ptr, dh0_ptr, dc0_ptr, dhbuf_ptr, dcbuf_ptr, step_ptr,
    T, B, H, P, NS,
    CELL: tl.constexpr, NG: tl.constexpr, D: tl.constexpr, PROJ: tl.constexpr, HAS_LEN: tl.constexpr,
    ACC: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    PHASE: tl.constexpr,
):  # fmt: skip
    """PHASE 0: gate gradients of hidden tile program_id(0); PHASE 1: the state gradient's tile."""
    s = tl.load(step_ptr)
    d = tl.program_id(2)
    b, b_mask = _batch(tl.program_id(1), B, BLOCK_B)
    n = _lengths(len_ptr, b, b_mask, T, HAS_LEN)
    if PHASE == 0:
        _grad_gates_tile(
            dy_ptr, whr_ptr, sv_ptr, hbuf_ptr, cbuf_ptr, da_ptr, dah_ptr, dhs_ptr, dc0_ptr, dhbuf_ptr,
            dcbuf_ptr, s, tl.program_id(0), d, b, b_mask, n, T, B, H, P, NS,
            CELL, NG, D, PROJ, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_H, BLOCK_K, "",
        )  # fmt: skip
    else:
        _grad_state_tile(
            dy_ptr, whh_ptr, sv_ptr, da_ptr, dah_ptr, dh0_ptr, dhbuf_ptr, s, tl.program_id(0), d, b,
            b_mask, n, T, B, H, P, CELL, NG, D, ACC, PRECISION, UPCAST, BLOCK_B, BLOCK_P, BLOCK_K, "",
        )  # fmt: skip
