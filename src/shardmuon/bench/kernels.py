"""``shardmuon bench step --kernels``: what one optimizer step launches, by phase.

Three counts per phase of a step (after warm-up steps, so the plan is built):

* **ATen calls**: the outermost non-view ATen operators the step calls from Python (what
  a ``TorchDispatchMode`` sees; views cost no kernel and almost no host time).
* **Device kernels** (estimated): on the accelerator path, every ATen call that computes on
  a device tensor is one kernel (an allocation is none), a ``_foreach_`` call one kernel per
  launch of torch's multi-tensor apply (tensors per launch by list depth), or one per tensor
  where a CPU scalar tensor sends it down the per-tensor path.
* **Host syncs**: the calls that read a device value on the host (``.item()``, ``bool()``,
  ``.tolist()``, ``nonzero``, boolean-mask indexing).

The accelerator path is counted without an accelerator: the parameters, grads and state
live on the ``meta`` device, which takes every branch a CUDA tensor takes (no host checks,
fp64 norms, ...) while computing nothing, so the count of a large model is quick on a CPU.
A host read of a meta value is recorded as a sync and answered with a zero. The CPU path
runs the real step on CPU tensors (its ATen calls are its host cost).

Phases are found from the Python stack of each call (innermost match wins): ``momentum``,
``gather`` (the directions into the workspace and the all-to-all), ``normalize``,
``iterate`` (the Newton-Schulz iteration), ``update`` (results back and the weight
update), ``sinkhorn``, ``adamw``, ``other`` (planning, agreement, bookkeeping).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "DEVICE_PATHS",
    "count_step",
]

DEVICE_PATHS = ("accelerator", "cpu")
PHASES = ("momentum", "gather", "normalize", "iterate", "update", "sinkhorn", "adamw", "other")

# (module, functions or None for any) -> phase. The innermost frame that matches wins.
_PHASE_OF: dict[str, tuple[tuple[frozenset[str] | None, str], ...]] = {
    "shardmuon.ops.normalize": ((None, "normalize"),),
    "shardmuon.ops.newton_schulz": ((None, "iterate"),),
    "shardmuon.ops.newton_schulz_gram": ((None, "iterate"),),
    "shardmuon.ops.newton_schulz_guard": ((None, "iterate"),),
    "shardmuon.ops.update": ((None, "update"),),
    "shardmuon.ops.sinkhorn": ((None, "sinkhorn"),),
    "shardmuon.runtime.sinkhorn_step": ((None, "sinkhorn"),),
    "shardmuon.ops.adamw": ((None, "adamw"),),
    "shardmuon.runtime.adamw_step": ((None, "adamw"),),
    "shardmuon.runtime.phases": (
        (frozenset({"_update_momentum", "update_all_momenta", "_segment_momentum"}), "momentum"),
        (frozenset({"prepare", "start_gather", "write_directions"}), "gather"),
        (frozenset({"finish", "share_with_replicas", "_results"}), "update"),
        (frozenset({"compute", "orthogonalize_run", "orthogonalize_directions"}), "iterate"),
    ),
}

# ATen calls that launch nothing on a device: allocation, scalar wrapping, metadata.
_NO_KERNEL = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.scalar_tensor.default",
    "aten.lift_fresh.default",
    "aten.detach.default",
    "aten.alias.default",
    "aten.set_.source_Storage",
    "aten.set_.source_Storage_storage_offset",
    "aten.resize_.default",
    "aten._local_scalar_dense.default",
    "aten.is_nonzero.default",
    "aten.sym_size.int",
    "aten.sym_numel.default",
    "aten.sym_stride.int",
    "aten.sym_storage_offset.default",
    "profiler._record_function_enter_new.default",
    "profiler._record_function_exit._RecordFunction",
}
# Calls whose result the host must read (their output size or value depends on data).
_SYNCS = {
    "aten._local_scalar_dense.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.unique_dim.default",
    "aten._unique2.default",
    "aten.repeat_interleave.Tensor",
}
# torch's multi-tensor apply: tensors per launch by the number of tensor lists.
_FOREACH_TENSORS_PER_LAUNCH = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}


@dataclass
class PhaseCounts:
    """One phase's ATen calls, estimated device kernels and host syncs."""

    aten_calls: int = 0
    kernels: int = 0
    syncs: int = 0

    def add(self, other: PhaseCounts) -> None:
        self.aten_calls += other.aten_calls
        self.kernels += other.kernels
        self.syncs += other.syncs


@dataclass
class LaunchReport:
    """What one step launched: per phase, in total, the busiest operators and where the
    host syncs were."""

    device_path: str
    batches: int = 0  # Muon batches of the plan (Newton-Schulz calls per step)
    phases: dict[str, PhaseCounts] = field(
        default_factory=lambda: {phase: PhaseCounts() for phase in PHASES}
    )
    operators: Counter = field(default_factory=Counter)
    sync_sites: Counter = field(default_factory=Counter)

    @property
    def total(self) -> PhaseCounts:
        out = PhaseCounts()
        for counts in self.phases.values():
            out.add(counts)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_path": self.device_path,
            "batches": self.batches,
            "total": asdict(self.total),
            "phases": {name: asdict(c) for name, c in self.phases.items()},
            "top_operators": dict(self.operators.most_common(20)),
            "sync_sites": dict(self.sync_sites),
        }

    def table(self) -> str:
        """The counts as an aligned text table, one row per phase and a total."""
        rows = [("phase", "ATen calls", "kernels", "host syncs")]
        for name, c in [*self.phases.items(), ("total", self.total)]:
            rows.append((name, str(c.aten_calls), str(c.kernels), str(c.syncs)))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths))
            )
            for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _phase(frame) -> str:
    while frame is not None:
        rules = _PHASE_OF.get(frame.f_globals.get("__name__", ""))
        if rules:
            name = frame.f_code.co_name
            for functions, phase in rules:
                if functions is None or name in functions:
                    return phase
        frame = frame.f_back
    return "other"


def _tensors(args: Iterable[Any]) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(list(args))
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def _foreach_launches(args: tuple, device_tensors: list[torch.Tensor], on_device) -> int:
    lists = [
        a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)
    ]
    count = max((len(a) for a in lists), default=0)
    if count == 0:
        return 0
    # A CPU tensor scalar (or list of them) beside device lists: torch's per-tensor path.
    host_scalars = [t for t in _tensors(args) if not on_device(t) and t.dim() == 0]
    if host_scalars and device_tensors:
        return count
    per_launch = _FOREACH_TENSORS_PER_LAUNCH.get(len(lists), 30)
    return math.ceil(count / per_launch)


class LaunchCounter(TorchDispatchMode):
    """Counts the ATen calls made inside it into a :class:`LaunchReport`. ``device``: the
    device type standing for the accelerator (``"meta"`` on the accelerator path); calls on
    it are kernels, host reads of it syncs (answered with zeros on ``meta``)."""

    def __init__(self, report: LaunchReport, device: str) -> None:
        super().__init__()
        self.report = report
        self.device = device

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            return func(*args, **kwargs)
        name = str(func)
        phase = self.report.phases[_phase(sys._getframe(1))]
        phase.aten_calls += 1
        self.report.operators[name] += 1
        device_tensors = [t for t in _tensors(args) if self._on_device(t)]
        if name.startswith("aten._foreach_"):
            phase.kernels += _foreach_launches(args, device_tensors, self._on_device)
        elif device_tensors and name not in _NO_KERNEL:
            phase.kernels += 1
        if name in _SYNCS and device_tensors and self.device != "cpu":
            phase.syncs += 1
            self.report.sync_sites[f"{name} at {_site(sys._getframe(1))}"] += 1
            if self.device == "meta":
                return _meta_answer(func, args)
        return func(*args, **kwargs)


class _HostReads(TorchFunctionMode):
    """``.tolist()`` / ``.numpy()`` of a device tensor: a sync the dispatcher never sees."""

    def __init__(self, counter: LaunchCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if (
            func in (torch.Tensor.tolist, torch.Tensor.numpy)
            and counter.device != "cpu"
            and counter._on_device(args[0])
        ):
            phase = self.counter.report.phases[_phase(sys._getframe(1))]
            phase.syncs += 1
            self.counter.report.sync_sites[f"{func.__name__} at {_site(sys._getframe(1))}"] += 1
            if args[0].is_meta:
                return torch.zeros(args[0].shape, dtype=args[0].dtype).tolist()
        return func(*args, **kwargs)


def _site(frame) -> str:
    """The innermost shardmuon frame: ``module:line``."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("shardmuon.") and not module.startswith("shardmuon.bench.kernels"):
            return f"{module}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _meta_answer(func, args):
    """A host read of a meta value: zero (a scalar), or an empty selection."""
    name = str(func)
    if name == "aten._local_scalar_dense.default":
        return False if args[0].dtype == torch.bool else 0
    first = args[0]
    if name == "aten.nonzero.default":
        return torch.empty((0, first.dim()), dtype=torch.long, device="meta")
    return torch.empty((0,), dtype=first.dtype, device="meta")


def count_step(step: Callable[[], Any], device_path: str) -> LaunchReport:
    """Run ``step()`` once under a :class:`LaunchCounter` for ``device_path`` (the tensors
    it touches must already be on ``meta`` for ``"accelerator"``)."""
    if device_path not in DEVICE_PATHS:
        raise ValueError(f"device_path must be one of {DEVICE_PATHS}, got {device_path!r}")
    report = LaunchReport(device_path)
    counter = LaunchCounter(report, "meta" if device_path == "accelerator" else "cpu")
    with _HostReads(counter), counter:
        step()
    return report


def preset_params(
    model: str,
    *,
    layers: int | None,
    scale: int,
    device: str,
    seed: int = 0,
    vocab_size: int | None = None,
) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` for every parameter of a model preset (widths divided by
    ``scale``), on ``device`` (random on a CPU; nothing allocated on ``meta``)."""
    from shardmuon.harness.models import param_shapes

    shapes = param_shapes(model, layers, vocab_size=vocab_size, scale=scale)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, shape in shapes.items():
        if device == "meta":
            value = torch.empty(shape, device="meta")
        else:
            value = torch.randn(shape, generator=gen) * 0.02
        out.append((name, torch.nn.Parameter(value)))
    return out


@dataclass(frozen=True)
class KernelConfig:
    """What ``bench step --kernels`` counts: a preset (``layers``, widths / ``scale``) routed
    as in training, one shardmuon variant (``options``), on ``device_path``."""

    model: str = "qwen3-30b-a3b"
    layers: int | None = 4
    scale: int = 8
    device_path: str = "accelerator"
    workspace_bytes: int | None = None  # None: the default budget / scale**2
    warm_steps: int = 2
    seed: int = 0
    options: tuple[tuple[str, Any], ...] = ()


def measure_preset(config: KernelConfig) -> LaunchReport:
    """One step of ``config``'s model after ``warm_steps`` steps (the plan built and agreed),
    counted. The same grads every step (the count does not depend on their values)."""
    from shardmuon import Muon
    from shardmuon.harness.models import attention_dims
    from shardmuon.planning.workspace import DEFAULT_WORKSPACE_BYTES
    from shardmuon.routing import build_param_groups

    device = "meta" if config.device_path == "accelerator" else "cpu"
    named = preset_params(
        config.model, layers=config.layers, scale=config.scale, device=device, seed=config.seed
    )
    dims = attention_dims(config.model)
    dims["head_dim"] = max(1, dims["head_dim"] // config.scale)
    routed = build_param_groups(named, lr=0.02, weight_decay=0.1, **dims)
    workspace = config.workspace_bytes
    if workspace is None:
        workspace = max(1, DEFAULT_WORKSPACE_BYTES // config.scale**2)
    opt = Muon(
        routed.groups,
        matrix_partitions=routed.partitions,
        workspace_bytes=workspace,
        **dict(config.options),
    )
    gen = torch.Generator().manual_seed(config.seed + 1)
    for _, param in named:
        if device == "meta":
            param.grad = torch.empty(param.shape, device="meta")
        else:
            param.grad = torch.randn(param.shape, generator=gen) * 1e-3
    if device == "meta":
        # Warm steps on meta read nothing on the host either: answer those reads too.
        for _ in range(config.warm_steps):
            count_step(opt.step, config.device_path)
    else:
        for _ in range(config.warm_steps):
            opt.step()
    report = count_step(opt.step, config.device_path)
    report.batches = len(opt.plan.batches)
    return report
