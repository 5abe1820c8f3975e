"""Finalizing in a launch's last program: per-block int32 arrival counters, zero between launches.

A kernel whose programs each store partial sums can add them itself instead of a second launch:
every program arrives on its block's counter after its stores, and the last to arrive reads the
others' partials and finalizes (in a fixed order, so the result does not depend on who arrived
last). The last program resets the counter, so the buffer is zeroed once, when it is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .backend import INTERPRET

# The current stream's handle on a device, for keying per-stream buffers (0 under the interpreter).
current_stream: Callable[[int], int] = (lambda device: 0) if INTERPRET else torch._C._cuda_getCurrentRawStream


def arrival_counters(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``counters(x)``: ``n`` int32 arrival counters on x's device for the launches that finalize
    in their last program; zero between launches (the last program resets its counter). One set
    per device and stream: launches on one stream run in order, two streams' may overlap."""
    sets: dict[tuple[int, int], torch.Tensor] = {}

    def counters(x: torch.Tensor) -> torch.Tensor:
        device = x.get_device()
        key = (device, current_stream(device))
        found = sets.get(key)
        if found is None:
            found = sets[key] = torch.zeros(n, dtype=torch.int32, device=x.device)
        return found

    return counters


@triton.jit
def last_arrival(counter_ptr, arrivals):
    """Whether this program is the last of ``arrivals`` to reach the int32 ``counter`` (zero
    before; the last resets it for the next launch). The barrier puts every thread's stores
    before the release; after the acquire the last program reads what the others stored, past L1
    (".cg" loads)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel") == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
