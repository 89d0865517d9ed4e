"""``MuonSettings``: the optimizer-wide settings, each declared once, checked once.

A setting is a field of :class:`MuonSettings`: its default, its docstring (``doc``), a
one-line summary for command-line help (``summary``), what it accepts (``accepts``: the
check that refuses a value, naming it, and the type ``MuonConfig`` declares), a numeric
setting's range (``range``), and whether it belongs to what the plan is built from
(``planned``) and to what the ranks of a group must share (``agreed``). ``Muon`` takes each one as a keyword
argument and holds one frozen ``MuonSettings``: a public attribute of the same name reads
it, and assigning one builds a new settings object, so a bad value raises at the
assignment and nothing changes. ``MuonConfig`` checks its optimizer-wide fields by building
one, and ``shardmuon train`` takes its flags' help and ranges from the same metadata.

Group settings (``lr``, ``mu``, ``betas``, ...) are not here: they are torch.optim's live
param-group keys (``validation.py``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import torch

from shardmuon.ops.engines import (
    NS_CHOICES,
    check_restart_runs,
    engines_of,
    resolve_ns_dtype,
    resolve_restarts,
)
from shardmuon.ops.newton_schulz import Coefficients, check_preconditioner, resolve_coefficients
from shardmuon.ops.orthogonalizer import NewtonSchulzSettings

__all__ = [
    "SETTING_NAMES",
    "Accepts",
    "MuonSettings",
    "NumberRange",
    "setting_doc",
    "setting_field",
    "setting_property",
    "setting_summary",
    "settings_args",
    "settings_attribute",
]

CHECK_GRADS_CHOICES = ("first", "always", "never")
OFFLOAD_CHOICES = (None, "state")  # runtime/offload.py
OVERLAP_CHOICES = (None, "forward")  # runtime/overlap.py
# How AdamW groups are cut into chunks: one per group, or one per parameter (for a trainer
# that moves each chunk's state to the device and back).
ADAMW_CHUNKS_CHOICES = ("group", "parameter")
WORKSPACE_ACCEPTED = "an int > 0 (bytes) or 'auto'"

Check = Callable[[str, Any], None]


@dataclass(frozen=True)
class Accepts:
    """What a setting accepts: ``check(name, value)`` raises ``ValueError``/``TypeError``
    naming the setting, the value and what is accepted; ``config_type`` is the type
    ``MuonConfig`` declares for it (pydantic coerces parsed TOML/CLI text to it), and
    ``strict`` runs ``check`` before that coercion (an int setting: ``True`` is not 1)."""

    check: Check
    config_type: Any = Any
    strict: bool = False


@dataclass(frozen=True)
class NumberRange:
    """The finite numbers a setting accepts: from ``low`` up to ``high`` (``None``:
    unbounded), each bound excluded where ``low_open`` / ``high_open`` says so. The CLIs'
    numeric flag types (``harness.cli_support.Number``) hold one too."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        try:
            if not math.isfinite(value):
                return False
        except OverflowError:  # an int beyond any float (10**400)
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is None:
            return True
        return value < self.high if self.high_open else value <= self.high


def check_int(name: str, value: Any, low: int, accepted: str) -> None:
    """``value`` must be an int (not a bool) ``>= low``; ``accepted`` says so in the message."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {accepted}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def _choice(choices: Sequence[Any]) -> Accepts:
    """One of ``choices`` (``None`` among them: optional)."""

    def check(name: str, value: Any) -> None:
        if value not in choices:
            shown = ", ".join(map(repr, choices))
            raise ValueError(f"unknown {name} {value!r}; accepted: {shown}")

    named = tuple(c for c in choices if c is not None)
    config_type: Any = Literal[named]
    return Accepts(check, config_type | None if None in choices else config_type)


def _flag(words: str, *accepted: Any) -> Accepts:
    """``True``/``False`` (and ``None`` where ``accepted`` holds it); ``words`` says which."""

    def check(name: str, value: Any) -> None:
        if not (value in accepted and (value is None or isinstance(value, bool))):
            raise TypeError(f"{name} must be {words}, got {value!r}")

    return Accepts(check, bool | None if None in accepted else bool)


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if isinstance(value, int) and abs(value) > sys.float_info.max:  # no float holds it
        raise ValueError(
            f"{name} must be a finite number > 0, got an int of {len(str(abs(value)))} digits"
        )
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _at_least_one(name: str, value: Any) -> None:
    check_int(name, value, 1, "an int >= 1")


def _prefetch(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):  # a ValueError, as it was
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    _at_least_one(name, value)


def _workspace(name: str, value: Any) -> None:
    if value != "auto":
        check_int(name, value, 1, WORKSPACE_ACCEPTED)


def _with_engine(config_type: Any) -> Accepts:
    """Checked with the other Newton–Schulz settings (``check_engine_settings``)."""
    return Accepts(lambda name, value: None, config_type)


def setting(
    default: Any,
    doc: str,
    accepts: Accepts,
    *,
    summary: str = "",
    number_range: NumberRange | None = None,
    agreed: bool = True,
    planned: bool = False,
) -> Any:
    """One :class:`MuonSettings` field: its default and metadata (see the module docstring);
    ``number_range``: a numeric setting's range, as command-line help states it."""
    first = doc.split(". ")[0].split("; ")[0].rstrip(".")
    metadata = {"doc": doc, "summary": summary or first, "accepts": accepts}
    extra = {"range": number_range, "agreed": agreed, "planned": planned}
    return field(default=default, metadata={**metadata, **extra})


@dataclass(frozen=True, kw_only=True)
class MuonSettings:
    """Every optimizer-wide setting of ``Muon``, checked in ``__post_init__`` (in the order
    of the fields; the Newton–Schulz settings together, after the engine)."""

    update_rms: float = setting(
        0.2,
        'the update RMS of ``adjust_lr="rms_norm"`` (0.2 = dion).',
        Accepts(_positive_number, float, strict=True),
        number_range=NumberRange(0.0, low_open=True),
        summary="update RMS of Muon's rms_norm scaling",
        planned=True,
    )
    newton_schulz_coefficients: Coefficients | None = setting(
        None,
        "a preset of ``NS_PRESETS`` or ``(a, b, c)`` triples, one per iteration (kept as "
        'triples); ``None``: ``"dion"`` (``"aol"`` with the AOL preconditioner). The '
        "attribute ``coefficients`` reads the triples in use.",
        _with_engine(str | list[tuple[float, float, float]] | None),
        summary="Newton-Schulz coefficient preset",
    )
    max_in_flight: int = setting(
        3,
        "batches between the gather and the compute phase in ``step()`` (default 3); "
        "``max_concurrent_tasks`` is the same setting under prime-rl's name.",
        Accepts(_at_least_one, int, strict=True),
    )
    workspace_bytes: int | str = setting(
        "auto",
        "each rank's budget for the step's transient buffers (``planning/workspace.py``):"
        " batches enter flight while their bytes fit, local stacks are cut to fit; a "
        'batch larger than the budget runs alone. ``"auto"`` (default): 512 MiB on a CPU;'
        " on CUDA a sixteenth of the GPU's memory in whole 256 MiB, at least 512 MiB "
        "(``device_workspace_bytes``; a warning where less than twice that is free); "
        "resolved once, then an int like a given one (agreed by every rank, kept by "
        "copies).",
        Accepts(_workspace, int | Literal["auto"], strict=True),
        planned=True,
    )
    offload: str | None = setting(
        None,
        '``"state"``: the state in pinned host memory, each chunk\'s streamed in '
        "``offload_prefetch`` chunks ahead (``runtime/offload.py``); same bits.",
        _choice(OFFLOAD_CHOICES),
        agreed=False,
    )
    offload_prefetch: int = setting(
        2,
        'with ``offload="state"``, how many chunks ahead their state is streamed (default 2).',
        Accepts(_prefetch, int, strict=True),
        agreed=False,
    )
    newton_schulz_impl: str = setting(
        "folded",
        'the engine (``ops/engines.py``): ``"folded"`` (default), ``"gram"`` (fewer FLOPs'
        ' on wide matrices, guarded), ``"auto"`` (folded or guarded Gram per shape class,'
        " timed by rank 0 at the first step; ``state_dict()`` keeps the choice), "
        '``"per-matrix"`` (batch-invariant), ``"unfolded"`` (dion\'s), ``"compiled"``.',
        Accepts(_choice(NS_CHOICES).check, str, strict=True),
        summary="Newton-Schulz engine",
        planned=True,
    )
    newton_schulz_dtype: torch.dtype | str = setting(
        "bfloat16",
        "the iteration's dtype (bf16 default, fp16, fp32; bf16 results).",
        _with_engine(Literal["bfloat16", "float16", "float32"]),
        summary="Newton-Schulz iteration dtype",
        planned=True,
    )
    newton_schulz_restarts: tuple[int, ...] | None = setting(
        None,
        "Gram's restart steps (``None``: after 2, then every 3).",
        _with_engine(Any),
        planned=True,
    )
    newton_schulz_guard: bool | None = setting(
        None,
        "the divergence guard (``None``: on for Gram; certifies sigma_max <= 1.15x the "
        "band, ``ops/newton_schulz_guard.py``).",
        _with_engine(Any),
        planned=True,
    )
    newton_schulz_preconditioner: str | None = setting(
        None,
        "``None`` (dion's numerics) or ``\"aol\"`` (Turbo-Muon's row scaling from the first"
        " iteration's Gram matrix; 4 steps by default; keeps the epsilon floor: a grad "
        "far below epsilon is damped as without AOL, at every dtype).",
        _with_engine(Literal["aol"] | None),
        summary="Newton-Schulz preconditioner ('aol': Turbo-Muon's row scaling, then the "
        "4-step 'aol' coefficients unless --coefficients is given)",
        planned=True,
    )
    check_grads: str = setting(
        "first",
        "when a group's ranks verify (one small all-reduce) that they planned alike and a"
        ' grad is present on all or none: ``"first"`` step and after a plan change '
        '(default), ``"always"``, ``"never"`` (the plan still once; grads never). '
        "Whatever it says, every later step compares the live settings first (a 2-element"
        " all-reduce per group): an edit made on some ranks only raises on all.",
        _choice(CHECK_GRADS_CHOICES),
    )
    overlap: str | None = setting(
        None,
        '``"forward"``: ``step()`` checks, starts the step in the background and returns;'
        " with :meth:`overlap_with`, each module's next forward waits only for its own "
        "parameters' chunks (``runtime/overlap.py``). ``None`` (default): not.",
        _choice(OVERLAP_CHOICES),
    )
    adamw_chunks: str = setting(
        "group",
        '``"group"`` (default): one AdamW chunk per group in :meth:`chunks`; '
        '``"parameter"``: one per parameter (a trainer that moves each chunk\'s state to '
        "the device and back holds one parameter's at a time).",
        _choice(ADAMW_CHUNKS_CHOICES),
        planned=True,
    )
    cuda_graphs: bool | None = setting(
        None,
        "on CUDA, Newton–Schulz calls captured in CUDA graphs at their second call (per "
        "shape and engine) and replayed after (``runtime/graphs.py``): one launch instead"
        " of some twenty, the same bits; a guarded call then decides its recompute on the"
        " device (no host synchronisation). ``True``: every call; ``None`` (default): the"
        " guarded calls only (``newton_schulz_guard``, the Gram engine's default), whose "
        "eager form reads the device once a call; ``False``: none. Each captured call "
        "keeps its input and output (twice the stack's bf16 bytes, all of them within "
        "``workspace_bytes``) and the captures share one pool of intermediates. Ignored "
        "off CUDA.",
        _flag("None, True or False", None, True, False),
        agreed=False,  # a replayed graph computes what the eager call does
    )
    rotate_owners: bool = setting(
        True,
        "continue owners round-robin across batches (``False`` for benchmarks).",
        _flag("True or False", True, False),
        planned=True,
    )
    split_replicas: bool = setting(
        False,
        "HSDP: one replica orthogonalizes each batch and broadcasts the result over the "
        "replicate dim, instead of every replica repeating it. Plain (non-DTensor) "
        "parameters in a job of several processes are then taken as replicas over the "
        "whole job (DDP) and share the work the same way (their values and grads are "
        "compared across ranks with the plan; ranks that differ raise).",
        _flag("True or False", True, False),
        planned=True,
    )
    warmup: bool | None = setting(
        None,
        ":meth:`warmup` whenever a new plan first steps (its groups not yet warmed); "
        "``None`` (default): on where the parameters are on a GPU and a group's "
        "collectives run on NCCL, off elsewhere (gloo, one process). The attribute is "
        "``warmup_setting``.",
        _flag("True, False or None (on with NCCL)", True, False, None),
    )

    def __post_init__(self) -> None:
        if self.newton_schulz_coefficients is not None:
            triples = resolve_coefficients(self.newton_schulz_coefficients)
            object.__setattr__(self, "newton_schulz_coefficients", triples)
        for spec in dataclasses.fields(self):
            spec.metadata["accepts"].check(spec.name, getattr(self, spec.name))
            if spec.name == "newton_schulz_impl":
                raw = {name: getattr(self, name) for name in SETTING_NAMES}
                check_engine_settings(raw, len(self.coefficients))
        object.__setattr__(self, "newton_schulz_restarts", self.newton_schulz.restarts)
        object.__setattr__(self, "update_rms", float(self.update_rms))

    @property
    def coefficients(self) -> Coefficients:
        """The iteration's ``(a, b, c)`` triples: the given ones, else the preconditioner's
        default (dion's 5 steps; AOL's 4)."""
        if self.newton_schulz_coefficients is not None:
            return self.newton_schulz_coefficients
        return resolve_coefficients("aol" if self.newton_schulz_preconditioner == "aol" else None)

    @cached_property
    def newton_schulz(self) -> NewtonSchulzSettings:
        """The Newton–Schulz settings resolved (a torch dtype, checked restarts, triples):
        what the engine, its cost model and ``"auto"``'s calibration are built from."""
        coefficients = self.coefficients
        return NewtonSchulzSettings(
            impl=self.newton_schulz_impl,
            dtype=resolve_ns_dtype(self.newton_schulz_dtype),
            restarts=resolve_restarts(self.newton_schulz_restarts, len(coefficients)),
            guard=self.newton_schulz_guard,
            preconditioner=self.newton_schulz_preconditioner,
            coefficients=coefficients,
        )

    def replace(self, **changes: Any) -> MuonSettings:
        """A copy with ``changes``, checked (the original is left as it was)."""
        return dataclasses.replace(self, **changes)

    def planned(self) -> dict[str, Any]:
        """What the plan is built from (besides the groups): a change rebuilds it."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["planned"]
        }

    def agreed(self) -> dict[str, Any]:
        """What the ranks of a group must share, one spelling per value (a preset's name is
        its triples, ``"float32"`` is ``torch.float32``): the agreement digest's settings."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["agreed"]
        }
        del out["newton_schulz_coefficients"]
        out["coefficients"] = self.coefficients
        out["newton_schulz_dtype"] = str(self.newton_schulz.dtype)
        return out

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> MuonSettings:
        """Settings from the known keys of ``values`` (a copy's saved settings may hold
        others, from older versions: left out)."""
        names = set(SETTING_NAMES)
        return cls(**{k: v for k, v in values.items() if k in names})


SETTING_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(MuonSettings))


def setting_field(name: str) -> dataclasses.Field:
    """Setting ``name``'s field (its default and metadata); ``KeyError`` naming the fields."""
    for spec in dataclasses.fields(MuonSettings):
        if spec.name == name:
            return spec
    raise KeyError(f"{name!r} is not a MuonSettings field; fields: {', '.join(SETTING_NAMES)}")


def settings_attribute() -> property:
    """An optimizer's ``settings`` attribute: holds a :class:`MuonSettings` and refuses
    anything else, naming it (``opt.settings.replace(...)`` makes a changed copy)."""

    def read(owner: Any) -> MuonSettings:
        return owner.__dict__["_settings"]

    def assign(owner: Any, value: Any) -> None:
        if not isinstance(value, MuonSettings):
            raise TypeError(
                f"settings must be a MuonSettings (opt.settings.replace(name=value) makes a "
                f"changed copy), got {type(value).__name__}"
            )
        owner.__dict__["_settings"] = value

    return property(read, assign, doc="The optimizer-wide settings (a frozen ``MuonSettings``).")


def setting_property(name: str) -> property:
    """An attribute that reads setting ``name`` from its owner's ``settings`` and, assigned,
    replaces ``settings`` with a checked copy. The Newton–Schulz settings are checked
    together, so a refusal there says how to change several at once."""

    def read(owner: Any) -> Any:
        return getattr(owner.settings, name)

    def assign(owner: Any, value: Any) -> None:
        try:
            owner.settings = owner.settings.replace(**{name: value})
        except (TypeError, ValueError) as err:
            if not name.startswith("newton_schulz_"):
                raise
            hint = f"; to change settings checked together at once: opt.settings = opt.settings.replace({name}=..., ...)"
            raise type(err)(f"{err}{hint}") from None

    return property(read, assign, doc=setting_doc(name))


def setting_doc(name: str) -> str:
    """The docstring of setting ``name``."""
    return setting_field(name).metadata["doc"]


def setting_summary(name: str) -> str:
    """The one-line summary of setting ``name`` (command-line help)."""
    return setting_field(name).metadata["summary"]


def check_engine_settings(settings: Mapping[str, Any], steps: int) -> None:
    """The Newton–Schulz settings together (``newton_schulz_impl`` already one of
    ``NS_CHOICES``), as given: the dtype the engine runs in, restarts (checked, and only
    where the engine restarts, at most every 3 steps of a ``steps``-step schedule), the
    preconditioner and the guard."""
    impl = settings["newton_schulz_impl"]
    dtype = resolve_ns_dtype(settings["newton_schulz_dtype"])
    for engine in engines_of(impl):
        if dtype not in engine.dtypes:
            raise ValueError(
                f"newton_schulz_impl={engine.name!r} does not run in {dtype}; it runs in "
                f"{', '.join(map(str, engine.dtypes))}"
            )
    restarts = resolve_restarts(settings["newton_schulz_restarts"], steps)
    if restarts is not None and not any(e.takes_restarts for e in engines_of(impl)):
        raise ValueError(
            f"newton_schulz_restarts={restarts!r} applies to newton_schulz_impl='gram' "
            f"(or 'auto'), not {impl!r}, which never restarts; drop it or choose 'gram'"
        )
    if any(e.takes_restarts for e in engines_of(impl)):
        check_restart_runs(restarts, steps)
    check_preconditioner(settings["newton_schulz_preconditioner"])
    guard = settings["newton_schulz_guard"]
    if not (guard is None or isinstance(guard, bool)):
        raise TypeError(f"newton_schulz_guard must be None, True or False, got {guard!r}")


def settings_args(indent: int) -> str:
    """The settings as a docstring's ``Args`` entries (``name: doc``, wrapped), for
    ``Muon``'s docstring; ``newton_schulz_coefficients`` first, as the signature has it."""
    lines = []
    for name in SETTING_NAMES:
        text = f"{name}: {setting_doc(name)}"
        lines += textwrap.wrap(
            text,
            92,
            break_on_hyphens=False,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
        )
    return "\n".join(lines)
