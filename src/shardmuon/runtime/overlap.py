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
from shardmuon.planning.groups import group_of_ranks, made_in_this_world
from shardmuon.planning.placements import local_tensor
from shardmuon.planning.plan import SinkhornChunk
from shardmuon.runtime.warmup import warm_up, warmup_sizes

__all__ = [
    "ForwardOverlap",
    "OverlapError",
    "OverlappedStep",
    "ReadMap",
    "forward_order",
    "snapshot_grads",
    "snapshot_group",
    "step_process_groups",
    "synchronize_all",
]


# Seconds between checks while waiting: a KeyboardInterrupt is seen this often.
_POLL_SECONDS = 0.1

ChunkKey = tuple[str, int]  # ("batch", i), ("sinkhorn", k) or ("adamw", k)


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


def step_groups_of(
    batches: Sequence[MuonBatch], sinkhorn: Sequence[SinkhornChunk] = ()
) -> set[tuple[int, ...]]:
    """The global ranks of every group the step's collectives run over on this rank (each
    exchanged batch's group; each split replica's; each group a Sinkhorn parameter's sums
    run over)."""
    out = {
        tuple(sorted(g.ranks))
        for chunk in sinkhorn
        for g in (*chunk.layout.row_groups, *chunk.layout.col_groups)
    }
    for batch in batches:
        layout = batch.layout
        if layout.exchanged:
            out.add(tuple(sorted(layout.group.ranks)))
        if batch.replica is not None:
            out.add(tuple(sorted(layout.replicas.ranks)))
    return {ranks for ranks in out if len(ranks) > 1}


# The step's own groups, by sorted global ranks (those this rank is in), for the process.
_STEP_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def step_process_groups(mine: set[tuple[int, ...]]) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """The overlapped step's own process group for each of ``mine`` (sorted global ranks):
    another communicator than the mesh's, so that the background step's collectives never
    interleave with the forward's (FSDP2's all-gathers) on one communicator in different
    orders on different ranks.

    Made by each group's members only, the first time an overlapped step of theirs needs it
    (:func:`shardmuon.planning.groups.group_of_ranks`; in ascending order of ranks, so no
    two ranks wait for each other in opposite orders), and kept for the process: shared by
    every overlapped optimizer (one overlapped step is in flight at a time: ``Muon.step``
    waits for every other first). No collective over the world: pipeline stages, and a rank
    whose plan talks to no one, make theirs, or none, at their own pace."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    made = made_in_this_world(_STEP_GROUPS)
    for ranks in sorted(mine):
        if ranks not in made:
            made[ranks] = group_of_ranks(ranks)
    return {ranks: made[ranks] for ranks in mine}


# Every overlapped step not yet waited for, so that code which reads parameters without
# knowing the optimizer (QK-clip) can wait for all of them.
_PENDING: weakref.WeakSet[OverlappedStep] = weakref.WeakSet()


def synchronize_all() -> None:
    """Wait for every overlapped step in flight in this process (raising its failure)."""
    for step in list(_PENDING):
        step.wait_all()


_WORKER_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def worker_stream(device: torch.device) -> torch.cuda.Stream:
    """The overlapped steps' stream on ``device``, one per device for the process: the
    caching allocator keeps freed blocks per stream, so a new stream per step would cache
    each step's transient anew (one overlapped step runs at a time)."""
    if device not in _WORKER_STREAMS:
        _WORKER_STREAMS[device] = torch.cuda.Stream(device=device)
    return _WORKER_STREAMS[device]


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
            # The grads (and their copies), on the caller's stream of the parameters' device.
            self._ready.record(torch.cuda.current_stream(device))
        self._device = device
        self._thread = threading.Thread(
            target=self._run, args=(work, device), name="shardmuon-overlap", daemon=True
        )
        _PENDING.add(self)
        self._thread.start()

    def _mark(self, key: ChunkKey) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))  # the worker's stream
            self._events[key] = event
        self._done[key].set()

    def _run(self, work, device: torch.device) -> None:
        try:
            with torch.no_grad():
                if self._cuda:
                    # A new thread's current device is 0: the parameters' device, or the
                    # worker makes a context there and records its events on its streams.
                    torch.cuda.set_device(device)
                    stream = worker_stream(device)
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
    def on_cuda(self) -> bool:
        """Whether the step runs on CUDA (its waits are stream waits on events)."""
        return self._cuda

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

    def wait_for(self, keys: Iterable[Hashable], streams: Sequence = ()) -> None:
        """Block until each of ``keys`` is done (raising the worker's failure); on CUDA the
        caller's stream, and each of ``streams`` (others that read the parameters: FSDP2's
        all-gather streams), wait for them instead of the host."""
        for key in keys:
            event = self._done.get(key)
            if event is None:
                continue
            self._wait(event)
            self._raise_if_failed()
            if self._cuda and key in self._events:
                torch.cuda.current_stream(self._device).wait_event(self._events[key])
                for stream in streams:
                    stream.wait_event(self._events[key])

    def wait_all(self, streams: Sequence = ()) -> None:
        """Block until the whole step is done; raise its failure if it failed. On CUDA the
        caller's stream and each of ``streams`` wait for every chunk."""
        self.discard()
        self._raise_if_failed()
        if self._cuda:
            for event in self._events.values():
                torch.cuda.current_stream(self._device).wait_event(event)
                for stream in streams:
                    stream.wait_event(event)

    def join(self) -> None:
        """Wait for the worker to finish (it writes nothing more); raise nothing."""
        self._wait(self._finished)
        self._thread.join()

    def discard(self) -> BaseException | None:
        """Wait for the worker, forget the step and return its failure (``None`` if none)."""
        self.join()
        _PENDING.discard(self)
        return self._error


def snapshot_group(group: dict) -> dict:
    """A param group as a step begins: its own ``params`` list, tensor values copied (a
    scheduler's ``fill_()`` of a tensor lr after ``step()`` returns is not seen)."""
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()}
    out["params"] = list(group["params"])
    return out


def snapshot_grads(params: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``id(p)`` -> a copy of ``p``'s local grad (parameters without one are left out).

    One fused ``_foreach_copy_`` on the caller's stream: an in-place write to the grads
    after ``step()`` returns (``zero_()``, the next backward accumulating into a
    persistent buffer) is ordered after the copy. Costs one grad-sized buffer, held until
    the step is done."""
    ids, sources, seen = [], [], set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            ids.append(id(p))
            sources.append(local_tensor(p.grad))
    copies = [torch.empty_like(t) for t in sources]
    if copies:
        torch._foreach_copy_(copies, sources)
    return dict(zip(ids, copies))


def chunks_of_params(plan, param_groups: Sequence[dict]) -> dict[int, set[ChunkKey]]:
    """``id(parameter)`` -> the chunks whose step writes it: the batches holding its matrices
    (several for a partitioned or widely stacked parameter), its Sinkhorn chunk, or its
    AdamW group's chunk."""
    out: dict[int, set[ChunkKey]] = {}
    for i, batch in enumerate(plan.batches):
        for segment in batch.segments:
            out.setdefault(id(plan.params[segment.param_index]), set()).add(("batch", i))
    for k, chunk in enumerate(plan.adamw):
        for p in chunk.params_of(param_groups):
            out.setdefault(id(p), set()).add(("adamw", k))
    for k, sinkhorn in enumerate(plan.sinkhorn):
        p = param_groups[sinkhorn.group_index]["params"][sinkhorn.param_index]
        out.setdefault(id(p), set()).add(("sinkhorn", k))
    return out


def _fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_all_gather_streams(unit: torch.nn.Module) -> list:
    """The streams FSDP2 reads ``unit``'s sharded parameters on besides the current one:
    its all-gather copy-in stream (and the all-gather stream after it). They wait on the
    current stream once per forward, in the root's pre-forward, so a wait on the current
    stream in a later unit's hook does not order them. Empty before FSDP2's lazy init (the
    root's pre-forward then orders them after the current stream, which has waited)."""
    try:
        comm = unit._get_fsdp_state()._comm_ctx
    except AttributeError:  # pragma: no cover - an FSDP2 without a comm context
        return []
    names = ("all_gather_copy_in_stream", "all_gather_stream")
    return [getattr(comm, name) for name in names if hasattr(comm, name)]


def _fsdp_unit_modules(unit: torch.nn.Module) -> list[torch.nn.Module]:
    """Every module of ``unit``'s FSDP2 unit (several for ``fully_shard([a, b])``, which
    all-gathers the parameters of all of them at once); ``[unit]`` where FSDP2 does not say."""
    try:
        modules = list(unit._get_fsdp_state()._modules)
    except AttributeError:  # pragma: no cover - an FSDP2 without grouped units
        return [unit]
    return modules or [unit]


def _fsdp_prefetched(unit: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 modules ``unit`` all-gathers right after its own all-gather
    (``set_modules_to_forward_prefetch``); read at each forward, as FSDP2 does."""
    try:
        states = unit._get_fsdp_state()._states_to_forward_prefetch
    except AttributeError:  # pragma: no cover - an FSDP2 without explicit prefetch
        return []
    return [m for state in states for m in getattr(state, "_modules", ())]


class ReadMap:
    """Which parameters each module's forward may read, as far as ``model``'s forwards show.

    - An FSDP2 module all-gathers every parameter of its unit (its subtree less nested FSDP2
      modules' subtrees) in its own pre-forward, and then those of the modules it
      prefetches (``set_modules_to_forward_prefetch``): it reads its own and theirs.
    - Any other module reads its own parameters (``recurse=False``) and may read a child's
      without running the child's forward (``nn.MultiheadAttention`` reads
      ``out_proj.weight``; a parent applies a child's weight functionally, an unused
      expert): it also reads those of every descendant not seen to run a forward of its
      own in every whole forward of ``model`` so far. Every module of ``model`` outside
      FSDP2 units whose subtree holds parameters is hooked, so the first forward waits for
      everything below the first module that runs, and each later one only for what no
      module of its own covers. Not covered: a module reading a child's parameter before
      that child's own forward in the same pass (a child that runs in every forward).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        units = _fsdp_units(model)
        unit_ids = {id(unit) for unit in units}
        in_units = {id(m) for unit in units for m in unit.modules()}
        self.own: dict[int, list[int]] = {}
        for unit in units:
            # One FSDP2 unit may span several modules (``fully_shard([a, b])``): the first
            # of them to run all-gathers the parameters of all.
            together = _fsdp_unit_modules(unit)
            grouped = {id(m) for m in together}
            nested = {
                id(p)
                for module in together
                for m in module.modules()
                if id(m) in unit_ids and id(m) not in grouped
                for p in m.parameters()
            }
            ids = dict.fromkeys(
                id(p) for module in together for p in module.parameters() if id(p) not in nested
            )
            self.own[id(unit)] = list(ids)
        covered: dict[int, bool] = {}  # id(module) -> its subtree holds parameters

        def holds(module: torch.nn.Module) -> bool:
            if id(module) not in covered:
                own = [] if id(module) in in_units else list(module.parameters(recurse=False))
                if id(module) not in unit_ids:
                    self.own[id(module)] = [id(p) for p in own]
                children = [holds(c) for c in module.children()]
                covered[id(module)] = bool(own) or any(children) or id(module) in unit_ids
            return covered[id(module)]

        holds(model)
        #: The modules to hook, in ``model.modules()`` order: every FSDP2 module, and every
        #: other one outside FSDP2 modules whose subtree holds parameters.
        self.modules = [
            m
            for m in model.modules()
            if id(m) in unit_ids or (id(m) not in in_units and covered.get(id(m)))
        ]
        self.units = unit_ids
        hooked = {id(m) for m in self.modules}
        self.children = {
            id(m): [c for c in m.children() if id(c) in hooked and id(c) not in unit_ids]
            for m in self.modules
        }
        self.root = model
        # Trusted to cover their own parameters: FSDP2 modules, and the modules seen to run
        # in every whole forward of ``model`` so far (none before the first has ended).
        self.ran: set[int] = set(unit_ids)
        self._every_pass: set[int] | None = None
        self._this_pass: set[int] = set()
        self._reads: dict[int, list[int]] = {}

    def begin_pass(self) -> None:
        """``model``'s own forward begins: the pass before it has ended. A module that did not
        run in it is not trusted again (its parent may read its weights when it is skipped:
        a branch taken on some forwards only)."""
        if self._this_pass:
            done = self._this_pass
            self._every_pass = done if self._every_pass is None else self._every_pass & done
            ran = self.units | self._every_pass
            if ran != self.ran:
                self.ran = ran
                self._reads.clear()
        self._this_pass = set()

    def saw_run(self, module: torch.nn.Module) -> None:
        """``module``'s forward runs (it counts towards the pass under way)."""
        if module is self.root:
            self.begin_pass()
        self._this_pass.add(id(module))

    def reads(self, module: torch.nn.Module) -> list[int]:
        """The ``id`` of every parameter ``module``'s forward may read (see the class)."""
        if id(module) in self.units:
            prefetched = _fsdp_prefetched(module)
            return [
                *self.own[id(module)],
                *(i for m in prefetched for i in self.own.get(id(m), ())),
            ]
        if id(module) not in self._reads:
            out, stack = list(self.own[id(module)]), list(self.children[id(module)])
            while stack:
                child = stack.pop()
                if id(child) not in self.ran:
                    out += self.own[id(child)]
                    stack += self.children[id(child)]
            self._reads[id(module)] = out
        return self._reads[id(module)]


class _Hook:
    """A hook of an overlapped optimizer on a model. A copy of the model (``deepcopy``,
    ``AveragedModel``, ``torch.save``) gets an inert one: its parameters are not the
    optimizer's."""

    def __init__(self, fn: Callable) -> None:
        # Never traced by torch.compile (a graph break): traced, its wait would be baked in
        # as it stood at compile time (nothing pending: no wait).
        self._fn = torch.compiler.disable(fn)

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)

    def __deepcopy__(self, memo) -> _InertHook:
        return _InertHook()

    def __reduce__(self):
        return (_InertHook, ())


class _InertHook:
    """What a copied :class:`_Hook` becomes: does nothing."""

    def __call__(self, *args) -> None:
        return None


class _CopyGuard:
    """The first entry of a hooked module's ``__dict__``: ``deepcopy`` and pickling visit it
    before any parameter, and it waits for the step in flight, so a copy holds the updated
    weights; the copy gets ``None`` in its place."""

    def __init__(self, overlap: ForwardOverlap) -> None:
        self._overlap = weakref.ref(overlap)

    def _wait(self) -> None:
        overlap = self._overlap()
        if overlap is not None:
            overlap.synchronize()

    def __deepcopy__(self, memo) -> None:
        self._wait()
        return None

    def __reduce__(self):
        self._wait()
        return (type(None), ())


class _GuardHandle:
    """Removes a :class:`_CopyGuard` (returned among the hook handles)."""

    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self._module, self._name = weakref.ref(module), name

    def remove(self) -> None:
        module = self._module()
        if module is not None:
            module.__dict__.pop(self._name, None)


def _let_compiled_code_see_hooks() -> None:
    """``torch.compile`` does not guard on module hooks by default: code traced before the
    hooks existed (a warm-up forward, another model of the same classes) would run without
    them. Turn those guards on (once per process) and drop what was compiled without them."""
    import torch._dynamo

    if torch._dynamo.config.skip_nnmodule_hook_guards:
        torch._dynamo.config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()


# FSDP2 modules whose explicit ``unshard()`` waits first, and what it waits for.
_UNSHARD_WAITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _UnshardHandle:
    def __init__(self, module: torch.nn.Module) -> None:
        self._module = weakref.ref(module)

    def remove(self) -> None:
        module = self._module()
        if module is not None:
            _UNSHARD_WAITS.pop(module, None)


def _wait_before_unshard(module: torch.nn.Module, wait: Callable[[], None]) -> _UnshardHandle:
    """Make ``module.unshard()`` call ``wait()`` first. ``FSDPModule.unshard`` is wrapped once
    per process; a module not registered here (a copy, another model) unshards as before,
    and FSDP2's own all-gather in the forward does not go through it."""
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.unshard
    if not getattr(original, "_shardmuon_waits", False):

        @functools.wraps(original)
        def unshard(self, *args, **kwargs):
            waits = _UNSHARD_WAITS.get(self)
            if waits is not None:
                waits()
            return original(self, *args, **kwargs)

        unshard._shardmuon_waits = True
        FSDPModule.unshard = unshard
    _UNSHARD_WAITS[module] = wait
    return _UnshardHandle(module)


def _guard_first(module: torch.nn.Module, name: str, guard: _CopyGuard) -> _GuardHandle:
    """Put ``guard`` first in ``module.__dict__`` (the order copies and pickles visit)."""
    entries = [(k, v) for k, v in module.__dict__.items() if k != name]
    module.__dict__.clear()
    module.__dict__[name] = guard
    module.__dict__.update(entries)
    return _GuardHandle(module, name)


class ForwardOverlap:
    """One optimizer's overlapped steps: starts each in the background, answers the
    forward's waits, and waits for it on demand (``Muon(overlap="forward")`` holds one)."""

    def __init__(self) -> None:
        self.pending: OverlappedStep | None = None
        # The plan the chunk map and step groups were made for (held: a new plan may reuse a
        # freed one's id()).
        self._chunks: tuple[object, dict[int, set[ChunkKey]]] = (None, {})
        self._step_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.failed: OverlapError | None = None
        self._stats = None  # the pending step's StepStats (its wait time goes there)
        self._hooked = self._warned = False
        self._units: list[weakref.ref] = []  # the hooked models' FSDP2 units

    def prepare(
        self, plan, param_groups: Sequence[dict], warm: bool | None, device: torch.device
    ) -> None:
        """For a new ``plan``: its chunk map, and the step's own process groups (made by their
        members, :func:`step_process_groups`), warmed on this thread as ``warm`` (the
        optimizer's ``warmup`` setting: ``runtime/warmup.py``) asks: their communicators
        are set up here, with nothing else in flight, not by the background step beside the
        forward's collectives."""
        if self._chunks[0] is plan:
            return
        self._step_groups = step_process_groups(step_groups_of(plan.batches, plan.sinkhorn))
        self._chunks = (plan, chunks_of_params(plan, param_groups))
        groups = {ranks: [group] for ranks, group in self._step_groups.items()}
        warm_up(groups, warmup_sizes(plan.batches, plan.sinkhorn), device, warm)

    def start(
        self,
        ctx,
        schedule: list[ChunkKey],
        stager,
        run_step: Callable,
        warm: bool | None = None,
    ) -> None:
        """Run ``run_step(ctx, schedule, stager, done)`` in the background on the step's own
        process groups (a new plan's made and warmed as ``warm`` asks first: :meth:`prepare`),
        holding the grads the step began with (``p.grad = None`` meanwhile, as
        ``zero_grad()`` does, is safe)."""
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
        # The step owns what it reads: the groups' settings (an lr scheduler may change them,
        # in place too, as soon as step() returns: tensor values are copied) and the grads
        # by value (a loop may zero them in place: model.zero_grad(set_to_none=False)).
        ctx.param_groups = [snapshot_group(group) for group in ctx.param_groups]
        self.prepare(plan, ctx.param_groups, warm, ctx.device)
        ctx.step_groups = self._step_groups
        ctx.grads = snapshot_grads(p for g in ctx.param_groups for p in g["params"])
        stats = ctx.stats

        def work(done: Callable[[ChunkKey], None]) -> None:
            stats.workspace_peak_bytes = run_step(ctx, schedule, stager, done)

        keys = [("batch", i) for i in range(len(plan.batches))]
        keys += [("adamw", k) for k in range(len(plan.adamw))]
        keys += [("sinkhorn", k) for k in range(len(plan.sinkhorn))]
        self.pending = OverlappedStep(work, keys, ctx.device, list(ctx.grads.values()))
        self._stats = stats

    def synchronize(self) -> None:
        """Wait for the step in flight, if any; raise :class:`OverlapError` if it failed, or
        if an earlier step failed and no restore (:meth:`discard`) came since."""
        self.raise_if_failed()
        pending = self.pending
        if pending is None:
            return
        try:
            with self._timed():
                pending.wait_all(self._fsdp_streams() if pending.on_cuda else ())
        except OverlapError as err:
            self.pending = None
            self.failed = err  # raised again by every later wait until a restore
            raise
        self.pending = None  # kept through an interrupted wait (Ctrl-C): waited for again

    def _fsdp_streams(self) -> list:
        """FSDP2's all-gather streams of the hooked models' units (each once): after a
        ``synchronize()`` no hook waits, and FSDP2's root pre-forward orders those streams
        after the current stream, or only after an event the caller gave
        (``set_post_optim_event``) that may predate the step's end."""
        streams: dict[int, object] = {}
        for ref in self._units:
            unit = ref()
            if unit is not None:
                for stream in fsdp_all_gather_streams(unit):
                    streams.setdefault(id(stream), stream)
        return list(streams.values())

    def raise_if_failed(self) -> None:
        """Raise while an earlier step's failure was raised and no restore came since."""
        if self.failed is not None:
            raise OverlapError(
                f"an overlapped optimizer step failed ({self.failed.__cause__!r}) and its "
                "updates are half applied: restore a checkpoint (the optimizer's "
                "load_state_dict) before running, stepping or saving again"
            ) from self.failed

    def discard(self) -> None:
        """Wait for the step in flight, if any, and forget its failure (a restore follows)."""
        self.failed = None
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.discard()

    def wait_for_params(self, ids: Iterable[int], streams: Sequence = ()) -> None:
        """Wait for the chunks holding the parameters ``ids``; on CUDA, ``streams`` wait too
        (see :meth:`OverlappedStep.wait_for`). A failure is kept: every later wait raises
        it until a restore."""
        self.raise_if_failed()
        pending = self.pending
        if pending is not None:
            chunks = self._chunks[1]
            try:
                with self._timed():
                    pending.wait_for((key for i in ids for key in chunks.get(i, ())), streams)
            except OverlapError as err:
                self.pending = None
                pending.discard()
                self.failed = err
                raise

    def before_unshard(self, reads: ReadMap, module: torch.nn.Module) -> None:
        """Before an explicit ``FSDPModule.unshard()`` (a pipeline schedule's prefetch): its
        all-gather reads what the module's forward would (:meth:`before_forward`)."""
        if self.pending is not None:
            self.wait_for_params(reads.reads(module), fsdp_all_gather_streams(module))

    def before_forward(self, reads: ReadMap, module: torch.nn.Module, *_hook_args) -> None:
        """A forward pre-hook: wait for what ``module``'s forward may read (:class:`ReadMap`)."""
        reads.saw_run(module)
        self.raise_if_failed()
        if self.pending is not None:
            streams = fsdp_all_gather_streams(module) if id(module) in reads.units else ()
            self.wait_for_params(reads.reads(module), streams)

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
        """A pre-forward hook (first in line) on each module :class:`ReadMap` lists; on
        ``model`` and each of those modules, ``state_dict`` and ``load_state_dict``
        pre-hooks that wait for the whole step (they read or write every parameter: a
        trainer's weight broadcast, checkpoint or restore right after ``step()``), and a
        guard that makes a copy of the module wait for it (:class:`_CopyGuard`)."""
        handles: list = []
        self._hooked = True
        _let_compiled_code_see_hooks()
        reads = ReadMap(model)
        self._units += [weakref.ref(m) for m in reads.modules if id(m) in reads.units]
        guard, name = _CopyGuard(self), f"_shardmuon_overlap_{id(self)}"
        for module in reads.modules:
            wait = _Hook(functools.partial(self.before_forward, reads, module))
            handles.append(module.register_forward_pre_hook(wait, prepend=True))
            if id(module) in reads.units:
                wait = functools.partial(self.before_unshard, reads, module)
                handles.append(_wait_before_unshard(module, wait))
        for module in {id(m): m for m in (model, *reads.modules)}.values():
            handles.append(module.register_state_dict_pre_hook(_Hook(self.before_state_dict)))
            handles.append(
                module.register_load_state_dict_pre_hook(_Hook(self.before_load_state_dict))
            )
            handles.append(_guard_first(module, name, guard))
        return handles
