"""Shared setup of the overlap tests: holding the background worker at a chunk."""

from __future__ import annotations

import threading

import shardmuon.runtime.overlap as overlap_module
from shardmuon import Muon


def hold_the_last_chunk(monkeypatch, opt: Muon) -> threading.Event:
    """The worker of ``opt``'s next overlapped steps waits before marking the last batch of
    its schedule done until the returned event is set (at most 10 s)."""
    release = threading.Event()
    mark = overlap_module.OverlappedStep._mark
    last = ("batch", max(i for _, i in opt.runner.schedule()))

    def hold_the_last(self, key):
        if key == last:
            release.wait(10)
        mark(self, key)

    monkeypatch.setattr(overlap_module.OverlappedStep, "_mark", hold_the_last)
    return release
