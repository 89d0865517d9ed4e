"""A trainer's own streamed offload through the chunk API (prime-rl's loop), with a stand-in
for host memory that shardmuon cannot touch by accident.

Between its steps a chunk's state is *parked*: the tensors go to a side store and the
optimizer's state holds meta-device placeholders of the same shape (``park``). Whatever
shardmuon reads, moves or writes of a parked chunk's state fails or is seen: a meta tensor
has no data, cannot be copied out, and is replaced only by code that re-places state. A
chunk is brought back (``unpark``) right before its ``step_chunk`` and parked right after, as
prime-rl moves each batch's state to the GPU and back.
"""

from __future__ import annotations

import torch

from shardmuon import Muon

__all__ = ["ParkedState", "streamed_step"]


class ParkedState:
    """The side store of parked state: ``{id(param): {key: tensor}}``."""

    def __init__(self, opt: Muon, counters: bool = True) -> None:
        self.opt = opt
        self.counters = counters  # the step counters are parked too (prime-rl moves them)
        self.store: dict[int, dict[str, torch.Tensor]] = {}
        self.placeholders: dict[int, dict[str, torch.Tensor]] = {}

    def park(self, params) -> None:
        for p in params:
            entry = self.opt.state[p]
            kept, holders = {}, {}
            for key, value in entry.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    if self.counters:
                        kept[key] = value.clone()  # "moved": a new tensor holds the count
                        entry[key] = kept[key]
                    continue
                kept[key] = value
                holders[key] = entry[key] = torch.empty_like(value, device="meta")
            self.store[id(p)], self.placeholders[id(p)] = kept, holders

    def unpark(self, params) -> None:
        for p in params:
            entry = self.opt.state[p]
            for key, holder in self.placeholders.pop(id(p)).items():
                assert entry[key] is holder, f"shardmuon replaced a parked {key!r}"
            entry.update(self.store.pop(id(p)))

    def park_all(self) -> None:
        self.park([p for g in self.opt.param_groups for p in g["params"]])


def streamed_step(opt: Muon, parked: ParkedState) -> list[int]:
    """One step as prime-rl streams it: per chunk, its state back, ``step_chunk``, parked
    again. Returns the number of parameters whose state was unparked at each chunk."""
    held = []
    for chunk in opt.chunks():
        params = opt.chunk_info(chunk).params
        parked.unpark(params)
        held.append(len(params))
        opt.step_chunk(chunk)
        parked.park(params)
    return held
