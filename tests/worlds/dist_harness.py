"""Spawn a gloo world once and run many named cases inside it.

Starting a process group costs seconds (importing torch, the TCP rendezvous), so each
world size is spawned once and runs a whole list of cases. A case is a function of a
per-rank context that raises on failure. Every rank writes its results (ok, message,
seconds per case) to ``<out_dir>/rank<r>.json`` after each case, so that the pytest
process can report each (world, case, rank) on its own, even when a later case hangs or
a rank dies. The world has a wall-clock limit; past it the processes are killed and every
case without a result fails with that reason and the tail of the rank's log.

A cases module (named as ``"module:ATTR"``) provides ``ATTR``: a dict name -> callable taking
the context, and optionally ``make_context(rank, world_size)`` (default: a
:class:`WorkerContext`). Modules are imported by name in the children, so they must be
importable from ``sys.path`` (spawn passes the parent's ``sys.path`` on).

A test module declares its worlds as ``WORLDS = WorldPlan(...)`` and takes the ``worlds``
fixture of ``tests/conftest.py``: ``{size: World}``, each world running the cases that were
collected; a test checks its case with ``worlds[size].check(name)``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from shardmuon.harness.processes import exit_worker

__all__ = [
    "CaseResult",
    "WorkerContext",
    "World",
    "WorldPlan",
    "Worlds",
    "case_registry",
    "free_ports",
    "launch_world",
]

# Lines of a rank's log shown when the world failed without a per-case result.
LOG_TAIL_LINES = 25


@dataclass
class WorkerContext:
    """What a case sees by default: its rank and the world size."""

    rank: int
    world_size: int


@dataclass(frozen=True)
class CaseResult:
    """One rank's outcome of one case."""

    ok: bool
    message: str = ""
    seconds: float = 0.0


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that were free a moment ago (held open together)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _load(spec: str):
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    return module, getattr(module, attr)


def _write_json(path: Path, payload: dict) -> None:
    # Write then rename: the parent may read while a rank is still writing.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _worker(
    rank: int,
    world_size: int,
    port: int,
    cases_spec: str,
    case_names: list[str],
    out_dir: str,
    collective_timeout_s: float,
) -> None:
    """One rank: init gloo, run every case in order, record each result."""
    out = Path(out_dir)
    log = open(out / f"rank{rank}.log", "w", buffering=1)  # noqa: SIM115 (lives until exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    result_path = out / f"rank{rank}.json"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=collective_timeout_s),
    )
    try:
        module, cases = _load(cases_spec)
        make_context = getattr(module, "make_context", WorkerContext)
        context = make_context(rank, world_size)
        for name in case_names:
            print(f"--- case {name}", flush=True)
            start = time.perf_counter()
            try:
                cases[name](context)
                outcome = {"ok": True, "message": ""}
            except Exception as error:  # a case failing is a result, not a crash
                text = traceback.format_exc(limit=-6)
                outcome = {"ok": False, "message": f"{type(error).__name__}: {error}\n{text}"}
                print(text, flush=True)
            outcome["seconds"] = time.perf_counter() - start
            results[name] = outcome
            _write_json(result_path, results)
            try:
                # Realign the ranks, so that a case that failed on one rank only cannot
                # pair its collectives with the next case's.
                dist.barrier()
            except Exception as error:
                message = f"world lost sync after case {name!r}: {type(error).__name__}: {error}"
                print(message, flush=True)
                break
    finally:
        _write_json(result_path, results)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        log.flush()
    exit_worker()


@dataclass
class World:
    """A running (or finished) world; :meth:`wait` joins it and reads the results."""

    world_size: int
    case_names: list[str]
    out_dir: Path
    timeout_s: float
    processes: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    error: str = ""
    _results: dict[str, dict[int, CaseResult]] | None = None

    def wait(self) -> dict[str, dict[int, CaseResult]]:
        """Join (killing the ranks past the deadline); ``{case: {rank: CaseResult}}``."""
        if self._results is not None:
            return self._results
        deadline = self.started + self.timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        alive = [r for r, p in enumerate(self.processes) if p.is_alive()]
        if alive:
            self.error = (
                f"world {self.world_size} hit its {self.timeout_s:.0f} s limit; ranks "
                f"{alive} were still running and were killed"
            )
            self.kill()
        else:
            codes = {r: p.exitcode for r, p in enumerate(self.processes) if p.exitcode}
            if codes:
                self.error = f"world {self.world_size}: ranks exited with codes {codes}"
        self._results = {name: {} for name in self.case_names}
        for rank in range(self.world_size):
            path = self.out_dir / f"rank{rank}.json"
            recorded = json.loads(path.read_text()) if path.exists() else {}
            for name, outcome in recorded.items():
                self._results.setdefault(name, {})[rank] = CaseResult(**outcome)
        return self._results

    def kill(self) -> None:
        """Stop this world's processes (only those this object started)."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)

    def log_tail(self, rank: int) -> str:
        path = self.out_dir / f"rank{rank}.log"
        if not path.exists():
            return "(no log)"
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def check(self, *cases: str) -> None:
        """Fail the calling test (``pytest.fail``, no traceback) with every rank's message
        for each of ``cases`` that failed or left no result."""
        import pytest

        failures = [message for case in cases for message in self.failures(case)]
        if failures:
            pytest.fail("\n\n".join(failures), pytrace=False)

    def failures(self, case: str) -> list[str]:
        """Messages for every rank where ``case`` failed or left no result; empty if it passed."""
        results = self.wait()[case]
        messages = []
        for rank in range(self.world_size):
            where = f"world {self.world_size}, rank {rank}, case {case!r}"
            outcome = results.get(rank)
            if outcome is None:
                reason = self.error or "the rank stopped before reaching this case"
                messages.append(f"{where}: no result ({reason}); log tail:\n{self.log_tail(rank)}")
            elif not outcome.ok:
                messages.append(f"{where}: {outcome.message}")
        return messages


# Imported once by the fork server, so that each rank starts without importing them again
# (torch's import is most of a spawned rank's start-up: about 40 worlds of 2-8 ranks run).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "shardmuon"]


def _rank_context():
    """Where ranks are started: forked from a fork server that has imported torch (no CUDA:
    the server never initialises it; gloo and the ranks' threads are made after the fork),
    else spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    multiprocessing.set_forkserver_preload(_PRELOAD)
    return multiprocessing.get_context("forkserver")


def launch_world(
    world_size: int,
    cases_spec: str,
    case_names: list[str],
    out_dir: Path,
    *,
    port: int | None = None,
    timeout_s: float = 600.0,
    collective_timeout_s: float = 90.0,
) -> World:
    """Start ``world_size`` spawned ranks running ``case_names`` from ``cases_spec``; no wait."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = port if port is not None else free_ports(1)[0]
    context = _rank_context()
    world = World(world_size, list(case_names), out_dir, timeout_s)
    for rank in range(world_size):
        process = context.Process(
            target=_worker,
            args=(
                rank,
                world_size,
                port,
                cases_spec,
                list(case_names),
                str(out_dir),
                collective_timeout_s,
            ),
            daemon=True,
        )
        process.start()
        world.processes.append(process)
    return world


@dataclass(frozen=True)
class WorldPlan:
    """The gloo worlds of one test module, declared as its ``WORLDS``: one world per size in
    ``sizes``, each running ``cases_for(size)`` from ``cases_spec``. The ``worlds`` fixture
    (``tests/conftest.py``) launches them, all at once, or ``one_at_a_time`` (each the first
    time a test needs it, after the ones before it have finished: at most one world's
    processes at a time, for large worlds on a small machine)."""

    cases_spec: str
    cases_for: Callable[[int], list[str]]
    sizes: tuple[int, ...]
    timeout_s: float = 300.0
    collective_timeout_s: float = 60.0
    one_at_a_time: bool = False
    # Cases that sweep exhaustively where the default run samples: marked ``exhaustive``
    # (left out of ``pytest -q``; ``.ci/run`` runs them after the suite).
    exhaustive: frozenset[str] = frozenset()

    def params(self, id_format: str = "world{world}-{name}") -> list:
        """A ``pytest.param(world, name)`` per case of every size, its id ``id_format``."""
        import pytest

        return [
            pytest.param(
                world,
                name,
                id=id_format.format(world=world, name=name),
                marks=[pytest.mark.exhaustive] if name in self.exhaustive else [],
            )
            for world in self.sizes
            for name in self.cases_for(world)
        ]

    @contextlib.contextmanager
    def running(self, make_dir: Callable[[str], Path], selected: dict[int, set[str]] | None = None):
        """Yield the :class:`Worlds` (killed on exit). ``selected``: the cases to run, by size
        (``None`` or empty: every case of every size). ``make_dir(name)`` gives each world its
        output folder (``mktemp``)."""
        worlds = Worlds(self, make_dir, selected or {})
        try:
            if not self.one_at_a_time:
                worlds.launch_all()
            yield worlds
        finally:
            worlds.kill()


class Worlds(Mapping):
    """``{size: World}`` of a :class:`WorldPlan`: the sizes with a case to run. A world not
    launched yet is launched when looked up, after the ones before it have finished."""

    def __init__(
        self, plan: WorldPlan, make_dir: Callable[[str], Path], selected: dict[int, set[str]]
    ) -> None:
        self.plan = plan
        self._make_dir = make_dir
        self._selected = selected
        self.sizes = tuple(s for s in plan.sizes if not selected or s in selected)
        self._launched: dict[int, World] = {}

    def launch_all(self) -> None:
        """Launch every world at once (each on its own port, all free a moment ago)."""
        for size, port in zip(self.sizes, free_ports(len(self.sizes))):
            self._launch(size, port)

    def names(self, size: int) -> list[str]:
        """The cases the world of ``size`` runs, in their module's order."""
        wanted = self._selected.get(size)
        return [n for n in self.plan.cases_for(size) if not self._selected or n in wanted]

    def _launch(self, size: int, port: int | None = None) -> None:
        self._launched[size] = launch_world(
            size,
            self.plan.cases_spec,
            self.names(size),
            self._make_dir(f"{self.plan.cases_spec.split(':')[0]}{size}"),
            port=port,
            timeout_s=self.plan.timeout_s,
            collective_timeout_s=self.plan.collective_timeout_s,
        )

    def __getitem__(self, size: int) -> World:
        if size not in self._launched:
            if size not in self.sizes:
                raise KeyError(size)
            for other in self._launched.values():
                other.wait()
            self._launch(size)
        return self._launched[size]

    def __iter__(self):
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def kill(self) -> None:
        """Stop every world launched (only the processes these worlds started)."""
        for world in self._launched.values():
            world.kill()


def case_registry() -> tuple[dict[str, Callable], Callable, Callable[[int], list[str]]]:
    """A cases module's registry: ``(CASES, case, cases_for)``, where ``@case(name, worlds)``
    registers a case for those world sizes and ``cases_for(size)`` lists them."""
    cases: dict[str, Callable] = {}
    worlds: dict[str, tuple[int, ...]] = {}

    def case(name: str, sizes: tuple[int, ...]):
        def register(fn: Callable) -> Callable:
            cases[name], worlds[name] = fn, sizes
            return fn

        return register

    def cases_for(world_size: int) -> list[str]:
        return [name for name in cases if world_size in worlds[name]]

    return cases, case, cases_for
