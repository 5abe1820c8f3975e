"""The recurrent family's problem and engines: cuDNN's persistent and standard RNN algorithms.

One problem is one layer's recurrence (both directions together), forward or backward.

* ``persistent``: one program per (batch block, direction) runs every step with W_hh (and W_hr)
  loaded once, held on chip (registers / shared memory) for the whole sequence, and the state in
  registers: cuDNN's persistent algorithm, for weights that fit one program.
* ``persistent-tiled``: the same program per (batch block, direction) looping over steps, but
  over tiles of hidden units too, streaming the weights from L1/L2 each step and passing the
  state through a global double buffer. Owning all of H for its rows, a program needs only its
  own barrier per step, never a grid-wide one (which would need every program resident at once,
  a cooperative launch, and could not run under the interpreter, whose programs run one after
  another). Good while the weights stay in L1 or the batch gives enough programs; each program
  rereads all of W_hh every step, so for large H it is bounded by one multiprocessor's cache
  bandwidth.
* ``persistent-spread``: the tiled kernels with the hidden tiles of a batch block shared by up
  to one program per multiprocessor (cuDNN's persistent algorithm spread over the GPU): each
  program rereads only its slice of the weights, from L1 when it fits; the programs of a batch
  block meet on a counter in global memory after each phase of a step, which needs them all
  resident at once (no more programs than multiprocessors; each takes a small share of one, so
  kernels running beside it, such as NCCL's, leave room). A GPU that runs fewer programs at once
  than its multiprocessor count (an MPS client with an active-thread limit) could leave a group
  waiting for a program that never starts: there, force another engine (``algo=``). The engine
  for large H, as cuDNN's persistent algorithm with its cooperative launch.
* ``per-step``: one launch per step (two with a projection, two per step backward), a program
  per (hidden tile, batch block, direction): many more programs, each reading only its slice of
  the weights, at the cost of a launch per step. The fallback for large hidden sizes.

Costs are microseconds on an H100-class GPU from a small model: the step's products at one
multiprocessor's rate, the weight bytes it rereads at its cache bandwidth, a fixed latency per
step (dependent loads, products and barriers) and per launch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ...core.backend import INTERPRET, sm_count
from ...core.config import config
from ...core.engine import Engine, Family, LaunchConfig, Problem
from ...core.launcher import cdiv, launcher
from . import kernels as K
from .reference import GATES

CELL_IDS = {"lstm": 0, "gru": 1, "rnn_tanh": 2, "rnn_relu": 3}
# Weights (W_hh and W_hr elements, padded) that one resident program keeps on chip: with 8 warps,
# 64 fp32 registers a thread; 16-bit weights take half the registers.
RESIDENT_ELEMENTS = {"float64": 8192, "float32": 16384, "float16": 32768, "bfloat16": 32768}

_FLOPS_PER_SM_US = {"float64": 0.25e6, "float32": 0.7e6, "tf32": 2.0e6, "float16": 3.0e6, "bfloat16": 3.0e6}
_L1_BYTES_PER_SM_US = 150e3
_L2_BYTES_PER_SM_US = 40e3
_L1_BYTES = 160 * 1024
_STEP_US = 1.5
_LAUNCH_US = 6.5  # H100, LSTM H512 B64 bf16 per-step forward: 9.6 us a step
_REDUCTION_STEP_US = 1.0  # a per-step program's dependent L2 reads, per BLOCK_K of the reduction
# A step of the spread engine beyond its products and reads: the programs meeting on a counter
# and the latency of the step's dependent loads (H100, LSTM H512 B64 bf16: 6.7 us a step).
_MEET_US = 5.0


@dataclasses.dataclass(frozen=True)
class RNNProblem(Problem):
    """One layer's recurrence. ``state``: the state width P (``hidden``, or the LSTM projection
    size); ``save``: a forward pass keeping what the backward pass needs."""

    cell: str
    backward: bool
    save: bool
    dtype: str
    steps: int
    batch: int
    hidden: int
    state: int
    directions: int
    bias: bool
    lengths: bool
    tf32: bool

    @property
    def gates(self) -> int:
        return GATES[self.cell]

    @property
    def proj(self) -> bool:
        return self.state != self.hidden

    @property
    def slots(self) -> int:
        """NS: time slots of the state buffers."""
        return self.steps + 1 if self.save or self.backward else 2

    @property
    def elem(self) -> int:
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)

    def resident_elements(self) -> int:
        h, p = _pad(self.hidden), _pad(self.state)
        return self.gates * h * p + (h * p if self.proj else 0)

    def weight_elements(self) -> int:
        return self.gates * self.hidden * self.state + (self.hidden * self.state if self.proj else 0)

    def rate(self) -> float:
        return _FLOPS_PER_SM_US["tf32" if self.tf32 else self.dtype]


def _int32_reasons(p: RNNProblem) -> list[str]:
    """The kernels index activations (x, y, sv, the state slots' columns) in int64 from the batch
    offsets, but the recurrent weights (D * G * P elements) and the state slots' rows
    (D * NS * B, times P in int64) in int32, which keeps the per-step address arithmetic cheap:
    past 2**31 those would wrap, so every engine refuses the problem (torch.nn falls back)."""
    reasons = []
    if p.directions * p.gates * p.hidden * p.state >= 2**31:
        reasons.append(
            f"recurrent weights of {p.directions * p.gates * p.hidden * p.state} elements reach 2**31 "
            "(int32 weight offsets)"
        )
    if p.directions * p.slots * p.batch >= 2**31:
        reasons.append(
            f"{p.directions * p.slots * p.batch} state rows (directions x time slots x batch) reach 2**31 "
            "(int32 row offsets)"
        )
    return reasons


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def dot_constexprs(p: RNNProblem) -> tuple:
    """ACC, PRECISION, UPCAST for the kernels' products. fp32 without TF32 multiplies as three
    TF32 products (each operand split into a TF32 head and tail; the tail x tail term dropped):
    about fp32's accuracy on tensor cores, where Triton's fp32 "ieee" dot runs on the FMA units
    at a fraction of the speed (H100, LSTM T256 B64 H512 forward recurrence: 4.3 ms against 10.3)."""
    acc = tl.float64 if p.dtype == "float64" else tl.float32
    if p.dtype != "float32":
        precision = "ieee"
    else:
        precision = "tf32" if p.tf32 else "tf32x3"
    return acc, precision, INTERPRET and p.dtype == "bfloat16"


def _describe(
    input: torch.Tensor,
    hidden_size: int,
    mode: str = "lstm",
    *,
    proj_size: int = 0,
    bidirectional: bool = False,
    batch_first: bool = False,
    bias: bool = True,
    backward: bool = False,
) -> RNNProblem:
    """The problem one layer of ``tdnn.lstm``/``gru``/``rnn`` on ``input`` poses (``mode``: "lstm",
    "gru", "rnn_tanh", "rnn_relu"); ``backward`` for the backward pass."""
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    dtype = str(input.dtype).removeprefix("torch.")
    return RNNProblem(
        mode, backward, backward, dtype, steps, batch, hidden_size, proj_size or hidden_size,
        2 if bidirectional else 1, bias, False, config.allow_tf32 and dtype == "float32",
    )  # fmt: skip


FAMILY: Family[RNNProblem] = Family("rnn", _describe)


def _block_b(p: RNNProblem, cap: int) -> int:
    return 16 if INTERPRET else min(cap, _pad(p.batch))


def _ints(p: RNNProblem) -> tuple[int, ...]:
    return (p.steps, p.batch, p.hidden, p.state, p.slots)


def _flags(p: RNNProblem) -> tuple:
    """The kernels' leading constexprs, forward (CELL ... SAVE) or backward (CELL ... HAS_LEN)."""
    cell, ng, d = CELL_IDS[p.cell], p.gates, p.directions
    if p.backward:
        return (cell, ng, d, p.proj, p.lengths)
    return (cell, ng, d, p.bias, p.proj, p.lengths, p.save)


def _init_state(hbuf, cbuf, h0, c0, p: RNNProblem) -> None:
    """Put h0 (and c0) in the slot of each direction's first step: time 0, or T - 1 reversed."""
    hbuf[0, 0].copy_(h0[0])
    if p.directions == 2:
        hbuf[1, p.steps % p.slots].copy_(h0[1])
    if p.cell == "lstm":
        cbuf[0, 0].copy_(c0[0])
        if p.directions == 2:
            cbuf[1, p.steps % p.slots].copy_(c0[1])


def _grad_buffers(dhn, dcn, p: RNNProblem):
    """The tiled backward's running state gradients: dhbuf (D, 2, B, P) from dhn, dcbuf from dcn."""
    acc = torch.float64 if p.dtype == "float64" else torch.float32
    dhbuf = dhn.new_empty((p.directions, 2, p.batch, p.state), dtype=acc)
    dhbuf[:, 0].copy_(dhn)
    dcbuf = dcn.to(acc, copy=True) if p.cell == "lstm" else dhbuf
    return dhbuf, dcbuf


_STEPS: dict[tuple[int, torch.device], list[torch.Tensor]] = {}


def _steps(n: int, device: torch.device) -> list[torch.Tensor]:
    """One int32 tensor per step holding its index, each 16-byte aligned (the launcher's fast path)."""
    key = (n, device)
    if key not in _STEPS:
        base = torch.arange(n, dtype=torch.int32, device=device).repeat_interleave(4)
        _STEPS[key] = [base[4 * s : 4 * s + 1] for s in range(n)]
    return _STEPS[key]


@FAMILY.register
class PersistentEngine(Engine[RNNProblem]):
    """Weights on chip for the whole sequence, state in registers: one launch per layer."""

    name = "persistent"

    def not_supported_reasons(self, p: RNNProblem) -> list[str]:
        limit = RESIDENT_ELEMENTS[p.dtype]
        if p.resident_elements() > limit:
            return [
                f"recurrent weights of {p.resident_elements()} elements (padded) per direction exceed the "
                f"{limit} one program keeps on chip"
            ]
        return _int32_reasons(p)

    def cost(self, p: RNNProblem) -> float:
        block_b = _block_b(p, 64)
        waves = cdiv(cdiv(p.batch, block_b) * p.directions, sm_count())
        flops = 2 * block_b * p.weight_elements()
        return p.steps * waves * (flops / p.rate() + _STEP_US)

    def configs(self, p: RNNProblem) -> list[LaunchConfig]:
        warps = 8 if p.resident_elements() > 4096 else 4
        out = [{"BLOCK_B": _block_b(p, 64), "num_warps": warps}]
        for bb in (16, 32):
            cfg = {"BLOCK_B": min(bb, _block_b(p, 64)), "num_warps": warps}
            if cfg not in out:
                out.append(cfg)
        return out

    def bind(self, p: RNNProblem, config: LaunchConfig) -> Callable[..., None]:
        bb = config["BLOCK_B"]
        acc = dot_constexprs(p)
        consts = (*_flags(p), *acc, bb, _pad(p.hidden), _pad(p.state))
        kernel = K._backward_resident_kernel if p.backward else K._forward_resident_kernel
        run = launcher(
            kernel, (cdiv(p.batch, bb), p.directions), 17 if p.backward else 14, _ints(p), consts,
            num_warps=config["num_warps"], num_stages=1,
        )  # fmt: skip
        if not p.backward:
            return run

        def backward(dy, dhn, dcn, whh, whr, lens, sv, hbuf, cbuf, ht, da, dah, dhs, dh0, dc0) -> None:
            run(dy, dhn, dcn, whh, whr, lens, sv, hbuf, cbuf, ht, da, dah, dhs, dh0, dc0, dy, dy)

        return backward


@FAMILY.register
class PersistentTiledEngine(Engine[RNNProblem]):
    """One launch per layer; weights streamed from cache in tiles each step."""

    name = "persistent-tiled"

    def not_supported_reasons(self, p: RNNProblem) -> list[str]:
        return _int32_reasons(p)

    def cost(self, p: RNNProblem) -> float:
        block_b = _block_b(p, 32)
        waves = cdiv(cdiv(p.batch, block_b) * p.directions, sm_count())
        weights = p.weight_elements() * p.elem
        rate = _L1_BYTES_PER_SM_US if weights <= _L1_BYTES else _L2_BYTES_PER_SM_US
        flops = 2 * block_b * p.weight_elements()
        phases = 2 if p.backward or p.proj else 1
        tiles = cdiv(p.hidden, 64) + (cdiv(p.state, 64) if phases == 2 else 0)  # a little latency each
        return p.steps * waves * (max(flops / p.rate(), weights / rate) + phases * _STEP_US + 0.1 * tiles)

    def configs(self, p: RNNProblem) -> list[LaunchConfig]:
        if INTERPRET:
            return [{"BLOCK_B": 16, "BLOCK_H": 16, "BLOCK_P": 16, "BLOCK_K": 16, "num_warps": 4}]
        bk = 32 if p.elem >= 4 else 64
        out = []
        for bb, bh, warps in ((_block_b(p, 32), 64, 4), (_block_b(p, 64), 64, 8), (16, 32, 4)):
            cfg = {"BLOCK_B": min(bb, _block_b(p, 64)), "BLOCK_H": min(bh, _pad(p.hidden)),
                   "BLOCK_P": min(bh, _pad(p.state)), "BLOCK_K": bk, "num_warps": warps}  # fmt: skip
            if cfg not in out:
                out.append(cfg)
        return out

    def bind(self, p: RNNProblem, config: LaunchConfig) -> Callable[..., None]:
        return _bind_tiled(p, {**config, "SPLIT": 1}, sync=False)


def _bind_tiled(p: RNNProblem, config: LaunchConfig, sync: bool) -> Callable[..., None]:
    """The tiled persistent kernels on grid (SPLIT, batch blocks, directions); ``sync``: the
    programs of a group synchronize through counters (zeroed each call)."""
    bb, split = config["BLOCK_B"], config["SPLIT"]
    blocks = (bb, config["BLOCK_H"], config["BLOCK_P"], config["BLOCK_K"])
    consts = (*_flags(p), *dot_constexprs(p), *blocks, split, sync, ".cg" if sync else "")
    owned = config.get("OWNED", False)
    tiles = cdiv(p.hidden, config["BLOCK_H"])
    if not p.backward:
        consts = (*consts, config.get("GATHER", False))
    elif owned:  # the shares of up to 16 unit tiles added at once
        consts = (*consts, min(16, triton.next_power_of_2(tiles)))
    kernel = K._forward_tiled_kernel
    if p.backward:
        kernel = K._backward_owned_kernel if owned else K._backward_tiled_kernel
    groups = cdiv(p.batch, bb) * p.directions
    run = launcher(
        kernel, (split, cdiv(p.batch, bb), p.directions), (19 if owned else 18) if p.backward else 15,
        _ints(p), consts, num_warps=config["num_warps"], num_stages=config.get("num_stages", 2),
    )  # fmt: skip

    def counters(like: torch.Tensor) -> torch.Tensor:
        return torch.zeros(groups, dtype=torch.int32, device=like.device) if sync else like

    if p.backward:

        def backward(dy, dhn, dcn, whh, whr, lens, sv, hbuf, cbuf, ht, da, dah, dhs, dh0, dc0) -> None:
            dhbuf, dcbuf = _grad_buffers(dhn, dcn, p)
            extra = ()
            if owned:  # the unit tiles' shares of the state gradient, by step parity; none before the first
                shares = dy.new_empty((p.directions, 2, tiles, p.batch, p.state), dtype=dhbuf.dtype)
                shares[:, 0].zero_()
                extra = (shares,)
            run(dy, dhn, dcn, whh, whr, lens, sv, hbuf, cbuf, ht, da, dah, dhs, dh0, dc0, dhbuf, dcbuf,
                counters(dy), *extra)  # fmt: skip

        return backward

    def forward(x, whh, bhh, whr, h0, c0, lens, y, hn, cn, sv, hbuf, cbuf, ht) -> None:
        _init_state(hbuf, cbuf, h0, c0, p)
        run(x, whh, bhh, whr, h0, c0, lens, y, hn, cn, sv, hbuf, cbuf, ht, counters(x))

    return forward


def _gathered(p: RNNProblem) -> bool:
    """Whether the spread engine's forward gathers a tile's gates into one product first: gated
    cells in the dtypes it was measured in (fp32, bf16; fp16 as bf16)."""
    return not p.backward and p.gates > 1 and p.elem <= 4


def _owned(p: RNNProblem) -> bool:
    """Whether the spread engine's one-phase backward (``OWNED``) applies: gated cells without
    projection."""
    return p.backward and p.gates > 1 and not p.proj


# The one-phase backward's shares of a step's state gradient (fp32, D x tiles x B x P) that it
# comes first up to: the measured shapes' 2-8 MB stay in L2; past it each step streams them.
_OWNED_SHARES_BYTES = 32 << 20
# Its tile shape (BLOCK_B, BLOCK_H, BLOCK_K: read only by a projection's tiles, stages).
_OWNED_SHAPE = (16, 16, 32, 2)


def _owned_first(p: RNNProblem) -> bool:
    """Whether the one-phase backward comes first: in fp32, where it ran 1.6-1.9x faster a step
    than the two-phase kernel (H200: LSTM H512 B64 10.9 against 20.2 us, H1024 B32 20.6 against
    37.8, H256 B128 6.8 against 11.3; GRU H512 10.9 against 17.8, H1024 19.8 against 33.3:
    ``scratch/rnn_owned.py``; not in bf16: 7.5 against 6.8), where, as there, each program owns
    one tile of 16 units and the shares stay in L2. With fewer programs than tiles a program adds
    up every tile's shares for each of its own, and the shares grow as B * H^2: there it is the
    second config (autotuning times it)."""
    if not _owned(p) or p.dtype != "float32":
        return False
    bb = min(_OWNED_SHAPE[0], _block_b(p, 64))
    tiles = cdiv(p.hidden, _OWNED_SHAPE[1])
    groups = cdiv(p.batch, bb) * p.directions
    shares = p.directions * tiles * p.batch * p.state * 4
    return sm_count() // groups >= tiles and shares <= _OWNED_SHARES_BYTES


@FAMILY.register
class PersistentSpreadEngine(Engine[RNNProblem]):
    """The persistent algorithm spread over multiprocessors: the hidden tiles of a batch block
    shared by up to one program per multiprocessor, each rereading its weight slice every step
    (from L1 where it fits), the programs meeting on a counter after each phase of a step."""

    name = "persistent-spread"

    def not_supported_reasons(self, p: RNNProblem) -> list[str]:
        return _int32_reasons(p)

    @staticmethod
    def _step_us(p: RNNProblem, cfg: LaunchConfig) -> float:
        """One step of one program: its tiles' products, its weight slice reread from L1 (L2 when
        it does not fit), the state rows read from L2 for each tile, and a meeting per phase."""
        bb, bh, split = cfg["BLOCK_B"], cfg["BLOCK_H"], cfg["SPLIT"]
        tiles = cdiv(cdiv(p.hidden, bh), split)
        phases = 2 if p.backward or p.proj else 1
        flops = 2 * bb * tiles * bh * p.gates * p.state * phases
        weights = tiles * bh * p.gates * p.state * p.elem * phases
        states = tiles * bb * p.state * p.elem * phases
        cache = _L1_BYTES_PER_SM_US if weights <= _L1_BYTES else _L2_BYTES_PER_SM_US
        meetings = 2 if p.proj else 1  # unprojected, a backward step's second phase needs none
        return max(flops / p.rate(), weights / cache, states / _L2_BYTES_PER_SM_US) + meetings * _MEET_US

    def cost(self, p: RNNProblem) -> float:
        return p.steps * self._step_us(p, self._shapes(p)[0])

    def configs(self, p: RNNProblem) -> list[LaunchConfig]:
        if INTERPRET:  # programs run one after another there: one program per group
            # The kernels the GPU runs first at the measured sizes: gated cells' forward with
            # gathered gates, their fp32 backward in one phase.
            cfg = {"BLOCK_B": 16, "BLOCK_H": 16, "BLOCK_P": 16, "BLOCK_K": 16, "SPLIT": 1, "num_warps": 4}
            if _owned(p) and p.dtype == "float32":
                cfg["OWNED"] = True
            elif _gathered(p):
                cfg["GATHER"] = True
            return [cfg]
        return self._shapes(p)

    @staticmethod
    def _shapes(p: RNNProblem) -> list[LaunchConfig]:
        """Tile shapes, each with as many programs per group as there are tiles and
        multiprocessors for (all must be resident at once). First the shape that was fastest on
        every shape swept (H100: LSTM H512 B64 and H1024 B32/B64, bf16 and fp32, forward and
        backward): 16 batch rows by 32 hidden units, 64-wide reduction steps (32 for the fp32
        backward: 5.16 / 4.79 ms against 5.63 / 5.17), 3 stages in 16 bits.
        A gated cell's forward first gathers its gates (``GATHER``, where ``_gathered``): 16 rows
        by 16 units, one 64-wide product where four 16-wide ones ran half as fast (H200, one
        layer's forward, us a step, fp32 / bf16: LSTM H512 B64 9.3 / 5.0 against the 16 x 32
        tiles' 12.8 / 6.2, H1024 B32 17.1 against 22.9, H256 B128 5.7 against 7.6; GRU 8.9, 16.4,
        5.4 against 11.9, 21.7, 7.2: ``scratch/rnn_gather.py``), over three stages, reduction
        steps of 64 (fp32) or 128 (16 bits), where two stages of 64 had been taken (us a step:
        LSTM fp32 H1024 B32 14.3 against 16.2, H512 B64 8.4 against 9.0, bf16 3.6 against 5.0;
        GRU 14.1 / 15.8, 8.2 / 8.6, 3.4 / 5.0: ``scratch/rnn_sweep.py``). Its backward:
        ``_owned_first``."""
        first = (16, 32, 32 if p.backward and p.elem == 4 else 64, 3 if p.elem < 4 else 2, {})
        others = ((16, 16, 64, 3), (32, 16, 64, 3), (16, 32, 32, 3), (32, 32, 64, 2))
        shapes = [first, *((*shape, {}) for shape in others)]
        if _gathered(p):
            shapes.insert(0, (16, 16, 64 if p.elem == 4 else 128, 3, {"GATHER": True}))
        if _owned(p):  # the one-phase backward (128-wide shares), first where it was measured faster
            owned = (*_OWNED_SHAPE, {"OWNED": True, "BLOCK_P": min(128, _pad(p.state))})
            shapes.insert(0 if _owned_first(p) else 1, owned)
        out: list[LaunchConfig] = []
        for bb, bh, bk, stages, kernel_flags in shapes:
            bb, bh = min(bb, _block_b(p, 64)), min(bh, _pad(min(p.hidden, p.state)))
            groups = cdiv(p.batch, bb) * p.directions
            split = max(1, min(cdiv(p.hidden, bh), sm_count() // groups))
            bk = bk if p.elem <= 4 else 32  # fp64 tiles: half the reduction step, as the other engines
            cfg = {"BLOCK_B": bb, "BLOCK_H": bh, "BLOCK_P": bh, "BLOCK_K": bk, "SPLIT": split,
                   "num_warps": 4, "num_stages": stages, **kernel_flags}  # fmt: skip
            if cfg not in out:
                out.append(cfg)
        return out

    def bind(self, p: RNNProblem, config: LaunchConfig) -> Callable[..., None]:
        return _bind_tiled(p, config, sync=True)


@FAMILY.register
class PerStepEngine(Engine[RNNProblem]):
    """A launch per step over (hidden tiles, batch blocks, directions): the large-H fallback."""

    name = "per-step"

    def not_supported_reasons(self, p: RNNProblem) -> list[str]:
        return _int32_reasons(p)

    @staticmethod
    def _step_us(p: RNNProblem, cfg: LaunchConfig) -> float:
        """One step: its launches, then waves of programs each multiplying a (BLOCK_B, P) state
        block by its (P, gates x BLOCK_H) weight slice, read from L2 one reduction step after
        another (their latency: H100 LSTM H512 B64 fp32 measured 29.6 us a step, H1024 B32 53)."""
        bb, bh = cfg["BLOCK_B"], cfg["BLOCK_H"]
        programs = cdiv(p.hidden, bh) * cdiv(p.batch, bb) * p.directions
        flops = 2 * bb * bh * p.gates * p.state
        nbytes = (bh * p.gates + bb) * p.state * p.elem
        latency = cdiv(p.state, cfg["BLOCK_K"]) * _REDUCTION_STEP_US
        work = max(flops / p.rate(), nbytes / _L2_BYTES_PER_SM_US) + _STEP_US / 2 + latency
        launches = 2 if p.backward or p.proj else 1
        return launches * (_LAUNCH_US + cdiv(programs, sm_count()) * work)

    def cost(self, p: RNNProblem) -> float:
        return p.steps * self._step_us(p, self._shapes(p)[0])

    def configs(self, p: RNNProblem) -> list[LaunchConfig]:
        if INTERPRET:
            return [{"BLOCK_B": 16, "BLOCK_H": 16, "BLOCK_P": 16, "BLOCK_K": 16, "num_warps": 4}]
        return self._shapes(p)

    def _shapes(self, p: RNNProblem) -> list[LaunchConfig]:
        """Tile shapes, the cheapest by the cost model first: enough programs to fill the GPU
        against weight slices small enough to stream quickly."""
        bk = 32 if p.elem >= 4 else 64
        out: list[LaunchConfig] = []
        for bb in (16, 32, 64):
            for bh in (16, 32, 64):
                cfg = {"BLOCK_B": min(bb, _block_b(p, 64)), "BLOCK_H": min(bh, _pad(p.hidden)),
                       "BLOCK_P": min(bh, _pad(p.state)), "BLOCK_K": bk,
                       "num_warps": 8 if bb * bh >= 2048 else 4}  # fmt: skip
                if cfg not in out:
                    out.append(cfg)
        return sorted(out, key=lambda cfg: self._step_us(p, cfg))

    def bind(self, p: RNNProblem, config: LaunchConfig) -> Callable[..., None]:
        bb, bh, bp = config["BLOCK_B"], config["BLOCK_H"], config["BLOCK_P"]
        consts = (*_flags(p), *dot_constexprs(p), bb, bh, bp, config["BLOCK_K"])
        kernel = K._backward_step_kernel if p.backward else K._forward_step_kernel
        n = 18 if p.backward else 15
        warps = config["num_warps"]
        gates = launcher(kernel, (cdiv(p.hidden, bh), cdiv(p.batch, bb), p.directions), n, _ints(p),
                         (*consts, 0), num_warps=warps, num_stages=2)  # fmt: skip
        second = None
        if p.backward or p.proj:
            second = launcher(kernel, (cdiv(p.state, bp), cdiv(p.batch, bb), p.directions), n, _ints(p),
                              (*consts, 1), num_warps=warps, num_stages=2)  # fmt: skip
        steps = functools.partial(_steps, p.steps)

        if p.backward:

            def backward(dy, dhn, dcn, whh, whr, lens, sv, hbuf, cbuf, ht, da, dah, dhs, dh0, dc0) -> None:
                dhbuf, dcbuf = _grad_buffers(dhn, dcn, p)
                args = (
                    dy,
                    dhn,
                    dcn,
                    whh,
                    whr,
                    lens,
                    sv,
                    hbuf,
                    cbuf,
                    ht,
                    da,
                    dah,
                    dhs,
                    dh0,
                    dc0,
                    dhbuf,
                    dcbuf,
                )
                for step in steps(dy.device):
                    gates(*args, step)
                    second(*args, step)

            return backward

        def forward(x, whh, bhh, whr, h0, c0, lens, y, hn, cn, sv, hbuf, cbuf, ht) -> None:
            _init_state(hbuf, cbuf, h0, c0, p)
            args = (x, whh, bhh, whr, h0, c0, lens, y, hn, cn, sv, hbuf, cbuf, ht)
            for step in steps(x.device):
                gates(*args, step)
                if second is not None:
                    second(*args, step)

        return forward
