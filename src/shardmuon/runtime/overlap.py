"""The step behind the next forward (``Muon(overlap="forward")``): a background worker runs
the step's schedule and marks each chunk done; the next forward's pre-hooks wait for the
chunks holding their module's parameters.

What runs where:

- The caller's thread runs everything that can refuse (the grad checks, the agreement
  check, the step counters) before the worker starts, so a refused step changes nothing
  and raises where it always did.
- The worker runs :func:`shardmuon.runtime.pipeline.run_step` on the step's own process
  groups (:func:`step_process_groups`: the same ranks as the mesh's groups, made once), so
  its all-to-alls never share a communicator with FSDP2's all-gathers, which the caller's
  thread issues meanwhile. Each rank issues the same collectives in the same order per
  group as a sequential step (the schedule is in the agreement digest).
- On CPU the worker is a thread (GEMMs and gloo collectives release the GIL). On CUDA it
  also runs on its own stream, which first waits for the caller's stream (the grads), and
  records one event per chunk; a waiting hook makes the caller's stream wait on it.

A failure in the worker is kept and raised in the caller's thread, once, at the next wait
(:class:`OverlapError`; ``load_state_dict`` discards it unraised); a peer whose collective
can no longer complete fails at its process group's timeout.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch
import torch.distributed as dist

from shardmuon.planning.batches import MuonBatch
from shardmuon.planning.placements import local_tensor

__all__ = [
    "OVERLAP_CHOICES",
    "ForwardOverlap",
    "OverlapError",
    "OverlappedStep",
    "chunks_of_params",
    "forward_order",
    "parameters_read_at",
    "step_groups_of",
    "step_process_groups",
    "synchronize_all",
]

OVERLAP_CHOICES = (None, "forward")

# Seconds between checks while waiting: a KeyboardInterrupt is seen this often.
_POLL_SECONDS = 0.1

ChunkKey = tuple[str, int]  # ("batch", i) or ("adamw", k)


class OverlapError(RuntimeError):
    """The overlapped step failed in the background; raised at the next wait."""


def forward_order(batches: Sequence[MuonBatch]) -> list[int]:
    """The batches' indices by their first parameter (the optimizer's parameter order, which
    is the model's when the parameters were given as ``model.parameters()``): the first
    layers' batches first. The key is the plan's ``first_param`` where set (an exchanged
    batch: the same on every rank of its group, though a rank holding fewer matrices has
    other segments or none), else the first segment's: every rank of a group derives the
    same order."""

    def first(i: int) -> int:
        batch = batches[i]
        if batch.first_param is not None:
            return batch.first_param
        return batch.segments[0].param_index if batch.segments else -1

    return sorted(range(len(batches)), key=lambda i: (first(i), i))


def step_groups_of(batches: Sequence[MuonBatch]) -> set[tuple[int, ...]]:
    """The global ranks of every group the step's collectives run over on this rank (each
    exchanged batch's group; each split replica's)."""
    out = set()
    for batch in batches:
        layout = batch.layout
        if layout.exchanged:
            out.add(tuple(sorted(layout.group.ranks)))
        if batch.replica is not None:
            out.add(tuple(sorted(layout.replicas.ranks)))
    return {ranks for ranks in out if len(ranks) > 1}


# The step's own groups, by sorted global ranks: every group any rank asked for (the same
# keys on every rank; the value is a non-member's placeholder where this rank is not in it).
_STEP_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def step_process_groups(mine: set[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The overlapped step's own process group for each of ``mine`` (sorted global ranks).

    A collective over the world, at every overlapped step whose plan is new: each rank's
    groups are gathered (one ``all_gather_object``) and those not made yet are made by every
    rank in sorted order, as ``new_group`` asks; made once per process, shared by every
    overlapped optimizer (one overlapped step is in flight at a time: ``Muon.step`` waits
    for every other first)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    gathered: list[list[tuple[int, ...]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, sorted(mine))
    union = sorted({tuple(ranks) for part in gathered for ranks in part} - set(_STEP_GROUPS))
    timeout = _default_timeout()
    for ranks in union:
        _STEP_GROUPS[ranks] = dist.new_group(list(ranks), timeout=timeout)
    return {ranks: _STEP_GROUPS[ranks] for ranks in mine}


def _default_timeout():
    """The timeout the job gave ``init_process_group`` (``new_group`` would otherwise take
    torch's 30-minute default): a peer's failure then surfaces as the job expects. ``None``
    (torch's default) where the backend does not say."""
    group = dist.distributed_c10d._get_default_group()
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        try:
            return group._get_backend(torch.device("cuda")).options._timeout
        except (AttributeError, RuntimeError):
            return None


# Every overlapped step not yet waited for, so that code which reads parameters without
# knowing the optimizer (QK-clip) can wait for all of them.
_PENDING: weakref.WeakSet[OverlappedStep] = weakref.WeakSet()


def synchronize_all() -> None:
    """Wait for every overlapped step in flight in this process (raising its failure)."""
    for step in list(_PENDING):
        step.wait_all()


class OverlappedStep:
    """One step's schedule run by a background worker; chunks marked done as they finish.

    ``work(mark_done)`` runs the step and calls ``mark_done(key)`` after each chunk; it runs
    under ``torch.no_grad()`` (grad mode is per thread). ``keys``: every chunk key
    ``work`` will mark, so that a wait for a chunk that is not part of the step returns.
    """

    def __init__(
        self,
        work: Callable[[Callable[[ChunkKey], None]], object],
        keys: Iterable[ChunkKey],
        device: torch.device,
        read_tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        self._done: dict[ChunkKey, threading.Event] = {k: threading.Event() for k in keys}
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self.result: object = None
        self._cuda = device.type == "cuda"
        # On CUDA: the caller's tensors the worker's stream reads (the grads), so that the
        # allocator does not reuse them while its kernels still may (record_stream).
        self._read_tensors = list(read_tensors)
        self._events: dict[ChunkKey, torch.cuda.Event] = {}
        self._ready = torch.cuda.Event() if self._cuda else None
        if self._ready is not None:
            self._ready.record()  # the grads, on the caller's stream
        self._thread = threading.Thread(
            target=self._run, args=(work, device), name="shardmuon-overlap", daemon=True
        )
        _PENDING.add(self)
        self._thread.start()

    def _mark(self, key: ChunkKey) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[key] = event
        self._done[key].set()

    def _run(self, work, device: torch.device) -> None:
        try:
            with torch.no_grad():
                if self._cuda:
                    stream = torch.cuda.Stream(device=device)
                    with torch.cuda.stream(stream):
                        stream.wait_event(self._ready)
                        for tensor in self._read_tensors:
                            tensor.record_stream(stream)
                        self._read_tensors = []
                        self.result = work(self._mark)
                else:
                    self.result = work(self._mark)
        except BaseException as err:
            self._error = err
        finally:
            self._finished.set()
            for event in self._done.values():
                event.set()  # nothing waits forever for a chunk a failure left undone

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OverlapError(
                f"the overlapped optimizer step failed in the background: "
                f"{type(self._error).__name__}: {self._error}"
            ) from self._error

    @staticmethod
    def _wait(event: threading.Event) -> None:
        while not event.wait(_POLL_SECONDS):  # in slices: Ctrl-C is seen
            pass

    def wait_for(self, keys: Iterable[Hashable]) -> None:
        """Block until each of ``keys`` is done (raising the worker's failure); on CUDA the
        caller's stream waits for them instead of the host."""
        for key in keys:
            event = self._done.get(key)
            if event is None:
                continue
            self._wait(event)
            self._raise_if_failed()
            if self._cuda and key in self._events:
                torch.cuda.current_stream().wait_event(self._events[key])

    def wait_all(self) -> None:
        """Block until the whole step is done; raise its failure if it failed."""
        self.discard()
        self._raise_if_failed()
        if self._cuda:
            for event in self._events.values():
                torch.cuda.current_stream().wait_event(event)

    def join(self) -> None:
        """Wait for the worker to finish (it writes nothing more); raise nothing."""
        self._wait(self._finished)
        self._thread.join()

    def discard(self) -> BaseException | None:
        """Wait for the worker, forget the step and return its failure (``None`` if none)."""
        self.join()
        _PENDING.discard(self)
        return self._error


def chunks_of_params(plan, param_groups: Sequence[dict]) -> dict[int, set[ChunkKey]]:
    """``id(parameter)`` -> the chunks whose step writes it: the batches holding its matrices
    (several for a partitioned or widely stacked parameter), or its AdamW group's chunk."""
    out: dict[int, set[ChunkKey]] = {}
    for i, batch in enumerate(plan.batches):
        for segment in batch.segments:
            out.setdefault(id(plan.params[segment.param_index]), set()).add(("batch", i))
    for k, chunk in enumerate(plan.adamw):
        for p in param_groups[chunk.group_index]["params"]:
            out.setdefault(id(p), set()).add(("adamw", k))
    return out


def _fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def parameters_read_at(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[int]]]:
    """Each module whose forward reads parameters first, and the ``id`` of those parameters,
    in ``model.modules()`` order.

    An FSDP2 module all-gathers every parameter of its unit (its subtree less nested FSDP2
    modules' subtrees) in its own pre-forward, so it waits for all of them; any other
    module with parameters of its own (``recurse=False``) outside such a unit waits for
    those.
    """
    units = _fsdp_units(model)
    unit_ids = {id(unit) for unit in units}
    inside_unit = {id(p) for unit in units for p in unit.parameters()}
    out = []
    for unit in units:
        nested = {
            id(p)
            for m in unit.modules()
            if m is not unit and id(m) in unit_ids
            for p in m.parameters()
        }
        own = [id(p) for p in unit.parameters() if id(p) not in nested]
        out.append((unit, own))
    for module in model.modules():
        if id(module) in unit_ids:
            continue
        own = [id(p) for p in module.parameters(recurse=False) if id(p) not in inside_unit]
        if own:
            out.append((module, own))
    order = {id(m): n for n, m in enumerate(model.modules())}
    return sorted(out, key=lambda item: order[id(item[0])])


class ForwardOverlap:
    """One optimizer's overlapped steps: starts each in the background, answers the
    forward's waits, and waits for it on demand (``Muon(overlap="forward")`` holds one)."""

    def __init__(self) -> None:
        self.pending: OverlappedStep | None = None
        self._chunks: tuple[int, dict[int, set[ChunkKey]]] = (0, {})
        self._stats = None  # the pending step's StepStats (its wait time goes there)
        self._hooked = self._warned = False

    def start(self, ctx, schedule: list[ChunkKey], stager, run_step: Callable) -> None:
        """Run ``run_step(ctx, schedule, stager, done)`` in the background on the step's own
        process groups, holding the grads the step began with (``p.grad = None`` meanwhile,
        as ``zero_grad()`` does, is safe)."""
        if not (self._hooked or self._warned):
            self._warned = True
            warnings.warn(
                "Muon(overlap='forward') stepped before overlap_with(model): nothing makes the "
                "next forward wait for the update; call opt.overlap_with(model) once, or "
                "opt.synchronize() before the parameters are read",
                UserWarning,
                stacklevel=3,
            )
        plan = ctx.plan
        # The groups' settings as the step began: an lr scheduler (or the user) may change
        # them as soon as step() returns, and AdamW reads them from the groups.
        ctx.param_groups = [dict(group) for group in ctx.param_groups]
        ctx.step_groups = step_process_groups(step_groups_of(plan.batches))
        ctx.grads = {id(p): p.grad for g in ctx.param_groups for p in g["params"]}
        if self._chunks[0] != id(plan):
            self._chunks = (id(plan), chunks_of_params(plan, ctx.param_groups))
        stats = ctx.stats

        def work(done: Callable[[ChunkKey], None]) -> None:
            stats.workspace_peak_bytes = run_step(ctx, schedule, stager, done)

        keys = [("batch", i) for i in range(len(plan.batches))]
        keys += [("adamw", k) for k in range(len(plan.adamw))]
        grads = [local_tensor(g) for g in ctx.grads.values() if g is not None]
        self.pending = OverlappedStep(work, keys, ctx.device, grads)
        self._stats = stats

    def synchronize(self) -> None:
        """Wait for the step in flight, if any; raise :class:`OverlapError` if it failed."""
        pending = self.pending
        if pending is None:
            return
        try:
            with self._timed():
                pending.wait_all()
        except OverlapError:
            self.pending = None  # raised once; a restore (load_state_dict) follows
            raise
        self.pending = None  # kept through an interrupted wait (Ctrl-C): waited for again

    def discard(self) -> None:
        """Wait for the step in flight, if any, and forget its failure (a restore follows)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.discard()

    def wait_for_params(self, ids: Sequence[int], *_hook_args) -> None:
        """Wait for the chunks holding the parameters ``ids`` (a forward pre-hook)."""
        pending = self.pending
        if pending is not None:
            chunks = self._chunks[1]
            with self._timed():
                pending.wait_for(key for i in ids for key in chunks.get(i, ()))

    @contextlib.contextmanager
    def _timed(self):
        began = time.perf_counter()
        try:
            yield
        finally:
            self._stats.overlap_wait_seconds += time.perf_counter() - began

    def before_state_dict(self, *_hook_args) -> None:
        """A module's ``state_dict`` pre-hook: :meth:`synchronize` (a checkpoint of a failed,
        half-applied step raises instead)."""
        self.synchronize()

    def before_load_state_dict(self, *_hook_args) -> None:
        """A module's ``load_state_dict`` pre-hook: wait until the worker writes nothing more;
        a failure stays pending for the next wait (or the optimizer's restore to discard)."""
        pending = self.pending
        if pending is not None:
            with self._timed():
                pending.join()

    def hook(self, model: torch.nn.Module) -> list:
        """A pre-forward hook (first in line) on each module of :func:`parameters_read_at`;
        on ``model`` and each of those modules, ``state_dict`` and ``load_state_dict``
        pre-hooks that wait for the whole step (they read or write every parameter: a
        trainer's weight broadcast, checkpoint or restore right after ``step()``)."""
        handles = []
        self._hooked = True
        read_at = parameters_read_at(model)
        for module, ids in read_at:
            wait = functools.partial(self.wait_for_params, ids)
            handles.append(module.register_forward_pre_hook(wait, prepend=True))
        for module in {id(m): m for m in (model, *(m for m, _ in read_at))}.values():
            handles.append(module.register_state_dict_pre_hook(self.before_state_dict))
            handles.append(module.register_load_state_dict_pre_hook(self.before_load_state_dict))
        return handles
