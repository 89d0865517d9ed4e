"""Optimizer-state offload (``Muon(offload="state")``): state in host memory, streamed per chunk.

``momentum`` and ``variance`` live in host memory (pinned when the parameters are on an
accelerator) from construction on. A step brings each chunk's state to the parameters'
device into a workspace buffer just before the chunk needs it (a Muon batch in its
*prepare* phase, the only phase that reads momentum; an AdamW chunk when it steps) and
sends it back right after, so at most ``prefetch`` chunks of state are on the device at
once: the chunk being stepped and the next ones, already loading.

On CUDA, loads run on a load stream and stores on a store stream, ordered with the compute
stream by events (a chunk's compute waits for its load; its store waits for the compute
that updated it; a load waits for earlier stores, so host memory is never read before it
was written back). Nothing synchronizes the host in the steady state; readers of the host
state (``state_dict``, ``load_state_dict``) call :meth:`StateStager.wait_host`. On a
CPU-only machine the same path runs synchronously with the workspace as a separate buffer,
so the tests exercise every step of it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from shardmuon.runtime.telemetry import StepStats

__all__ = ["StateStager", "host_copy", "stager_for"]


def host_copy(value: Tensor, device: torch.device) -> Tensor:
    """A contiguous host copy of a (local) state tensor, pinned if ``device`` is an accelerator."""
    pin = device.type != "cpu" and torch.cuda.is_available()
    host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
    host.copy_(value)
    return host


@dataclass
class _Staged:
    host: list[Tensor]
    device: list[Tensor]
    nbytes: int
    loaded: torch.cuda.Event | None = None


class StateStager:
    """Loads and stores chunks of state between host views and device workspace buffers.

    ``key`` identifies a chunk within a step; ``host`` are views of the host state (each
    written back in place by :meth:`store`). Counts bytes and the workspace peak into
    ``stats``.
    """

    def __init__(self, device: torch.device, prefetch: int, stats: StepStats) -> None:
        self.device = device
        self.prefetch = prefetch
        self.stats = stats
        self.cuda = device.type == "cuda"
        self._resident: OrderedDict[Hashable, _Staged] = OrderedDict()
        self._resident_bytes = 0
        self._stored: torch.cuda.Event | None = None
        if self.cuda:
            self._load_stream = torch.cuda.Stream(device)
            self._store_stream = torch.cuda.Stream(device)

    def load(self, key: Hashable, host: Sequence[Tensor]) -> None:
        """Start copying ``host`` views into new device buffers (async on CUDA)."""
        if key in self._resident:
            return
        host = list(host)
        nbytes = sum(t.numel() * t.element_size() for t in host)
        if self.cuda:
            # Host memory written back by earlier stores must be complete before reading it.
            self._load_stream.wait_stream(self._store_stream)
            with torch.cuda.stream(self._load_stream):
                device = [torch.empty_like(t, device=self.device) for t in host]
                for d, h in zip(device, host):
                    d.copy_(h, non_blocking=True)
                loaded = torch.cuda.Event()
                loaded.record(self._load_stream)
            staged = _Staged(host, device, nbytes, loaded)
        else:
            staged = _Staged(host, [t.clone() for t in host], nbytes)
        self._resident[key] = staged
        self._resident_bytes += nbytes
        self.stats.offload_bytes_loaded += nbytes
        self.stats.offload_workspace_peak_bytes = max(
            self.stats.offload_workspace_peak_bytes, self._resident_bytes
        )

    def acquire(self, key: Hashable) -> list[Tensor]:
        """The device buffers of a loaded chunk, usable on the current stream."""
        staged = self._resident[key]
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.loaded)
            for d in staged.device:
                d.record_stream(current)
        return staged.device

    def store(self, key: Hashable) -> None:
        """Copy a chunk's buffers back into its host views and release them (async on CUDA)."""
        staged = self._resident.pop(key, None)
        if staged is None:
            return
        if self.cuda:
            self._store_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._store_stream):
                for h, d in zip(staged.host, staged.device):
                    h.copy_(d, non_blocking=True)
                    d.record_stream(self._store_stream)
                self._stored = torch.cuda.Event()
                self._stored.record(self._store_stream)
        else:
            for h, d in zip(staged.host, staged.device):
                h.copy_(d)
        self._resident_bytes -= staged.nbytes
        self.stats.offload_bytes_stored += staged.nbytes

    def store_all(self) -> None:
        """Store every resident chunk (the end of a step, or after a failure)."""
        for key in list(self._resident):
            self.store(key)
        if self.cuda:
            # Later device work (the next step's loads included) is ordered after the stores.
            torch.cuda.current_stream(self.device).wait_stream(self._store_stream)

    def wait_host(self) -> None:
        """Block until every store has reached host memory (before the host state is read)."""
        if self._stored is not None:
            self._stored.synchronize()
            self._stored = None


def stager_for(
    existing: StateStager | None, device: torch.device, prefetch: int, stats: StepStats
) -> StateStager:
    """``existing`` if it stages ``prefetch`` chunks ahead on ``device`` (now reporting into
    ``stats``), else a new stager, once ``existing``'s stores have reached host memory (the
    new stager's loads read it and know nothing of the old one's stream)."""
    if existing is None or existing.prefetch != prefetch or existing.device != device:
        if existing is not None:
            existing.store_all()
            existing.wait_host()
        return StateStager(device, prefetch, stats)
    existing.stats = stats
    return existing
