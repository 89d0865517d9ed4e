"""``newton_schulz_impl="auto"``: which engine each shape class runs, measured once on the
device and the same on every rank.

Candidates are the engines of equal certified error (``ops.engines.AUTO_CANDIDATES``: the
folded iteration and the guarded Gram iteration, whose accepted restart schedules stay
within 1.05x the folded error, ``tests/ops/test_engine_promises.py``). A shape class is a
Newton–Schulz call's matrix shape ``(short, long)``; it is timed at the largest count of
matrices a call of this plan stacks for it.

Every rank's classes are gathered over the world, rank 0 times them all, and its choices
are broadcast: ranks that compute the same matrix (HSDP replicas without
``split_replicas``) then run the same engine and get the same bits, whatever each rank's
own timing noise. Choices are cached per process (device, dtype, preconditioner,
coefficients, restarts), so a rebuilt plan only times classes it has not seen.

A candidate that raises while it is timed (out of memory, say) is skipped, and a class
none of whose candidates ran gets :data:`DEFAULT_ENGINE`; each with a warning naming the
engine, the class and the error, issued by every rank, since the warnings travel with rank
0's table. If rank 0 raises otherwise, the other ranks raise too, instead of waiting for a
broadcast that never comes.

Timings vary run to run (three runs of one model chose folded, folded, gram for one
class), so the table is part of the checkpoint: ``Muon.state_dict()`` holds it under
:data:`STATE_DICT_KEY` with the settings it was measured under, and after
``load_state_dict`` its choices rule (no timing) while those settings hold; a state dict
without it (dion's, or one gathered by ``torch.distributed.checkpoint``, which keeps only
``state`` and ``param_groups``) is measured anew.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from shardmuon.ops.engines import AUTO_CANDIDATES
from shardmuon.ops.orthogonalizer import NewtonSchulzSettings, Orthogonalizer, auto_choice
from shardmuon.planning.batches import MuonBatch

__all__ = [
    "STATE_DICT_KEY",
    "calibrate",
    "calibrate_plan",
    "plan_shape_classes",
    "read_auto_record",
    "time_engines",
    "with_auto_record",
]

ShapeClass = tuple[int, int]
TIMED_REPEATS = 3
# What a class runs when no candidate could be timed on it (Muon's default engine).
DEFAULT_ENGINE = "folded"
# Where ``Muon.state_dict()`` keeps the table, beside ``state`` and ``param_groups``.
STATE_DICT_KEY = "newton_schulz_auto"
# Cache: settings key -> {shape class: engine name}.
_CHOICES: dict[tuple, dict[ShapeClass, str]] = {}


def plan_shape_classes(batches: Iterable[MuonBatch]) -> dict[ShapeClass, int]:
    """The ``(short, long)`` of every call this rank's batches make, with the largest
    number of matrices one call stacks (an owner's matrix alone; a local stack whole)."""
    classes: dict[ShapeClass, int] = {}
    for batch in batches:
        layout = batch.layout
        count = 1 if layout.exchanged else batch.num_matrices
        rows = layout.rows if layout.exchanged else layout.local_rows
        cols = layout.cols if layout.exchanged else layout.local_cols
        blocks = batch.partitions or (rows,)
        for size in set(blocks):
            same = blocks.count(size)
            key = (min(size, cols), max(size, cols))
            if min(key) > 0:
                classes[key] = max(classes.get(key, 0), count * same)
    return classes


def time_engines(
    make: Callable[[str], Orthogonalizer],
    shape: tuple[int, int, int],
    device: torch.device,
    coefficients,
    eps: float,
    repeats: int = TIMED_REPEATS,
    failed: dict[str, str] | None = None,
) -> dict[str, float]:
    """Median seconds of one call on a random bf16 ``shape`` per candidate engine.

    A candidate that raises (out of memory while timing it, say) is left out of the result;
    its error is written to ``failed[name]``.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(shape, generator=gen, device=device).to(torch.bfloat16)
    seconds = {}
    for name in AUTO_CANDIDATES:
        try:
            seconds[name] = _median_seconds(make(name), X, device, coefficients, eps, repeats)
        except Exception as err:  # any failure only rules this candidate out
            if failed is not None:
                failed[name] = _describe(err)
    return seconds


def _median_seconds(engine: Orthogonalizer, X, device, coefficients, eps, repeats) -> float:
    engine(X.clone(), coefficients, eps)  # warm-up (kernels, caches)
    samples = []
    for _ in range(repeats):
        G = X.clone()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        engine(G, coefficients, eps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    engine.take_report()
    return sorted(samples)[len(samples) // 2]


def _describe(err: BaseException) -> str:
    """``Type: first line of the message`` (CUDA's out-of-memory text runs on for lines)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _choose(
    timer: Callable[..., dict[str, float]], make, shape: tuple[int, int, int], *args
) -> tuple[str, list[str]]:
    """The fastest candidate ``timer`` ran on ``shape`` (``[count, short, long]``) and a
    warning per one that failed; the default engine, with a warning, when none ran."""
    count, m, n = shape
    failed: dict[str, str] = {}
    try:
        seconds = timer(make, shape, *args, failed=failed)
    except Exception as err:  # the class falls back to the default engine
        seconds, failed = {}, {"every candidate": _describe(err)}
    seconds = {name: s for name, s in seconds.items() if name in AUTO_CANDIDATES}
    where = f"shape class ({m}, {n}) (timed as a [{count}, {m}, {n}] stack)"
    notes = [
        f'newton_schulz_impl="auto": timing the {name!r} engine on {where} failed '
        f"({error}); it is not chosen for this class"
        for name, error in failed.items()
        if name != "every candidate"
    ]
    if seconds:
        return min(seconds, key=lambda name: (seconds[name], name)), notes
    reasons = "; ".join(f"{name}: {error}" for name, error in failed.items()) or "no timings"
    notes.append(
        f'newton_schulz_impl="auto": no candidate engine could be timed on {where} '
        f"({reasons}); it runs the default engine {DEFAULT_ENGINE!r}"
    )
    return DEFAULT_ENGINE, notes


def calibrate(
    classes: dict[ShapeClass, int],
    key: tuple,
    make: Callable[[str], Orthogonalizer],
    device: torch.device,
    coefficients,
    eps: float,
    timer: Callable[..., dict[str, float]] | None = None,
    preset: dict[ShapeClass, str] | None = None,
) -> dict[ShapeClass, str]:
    """The engine for each of ``classes`` (and every other rank's), the same on all ranks.

    ``preset``: choices that rule without timing (a loaded checkpoint's table; rank 0's is
    read). A candidate that fails while it is timed is skipped, a class whose candidates
    all fail runs :data:`DEFAULT_ENGINE`, each with a warning that every rank issues alike.

    Collective over the world when a process group is initialised (an all-gather of the
    classes and a broadcast of rank 0's choices); every rank must call it together. If rank
    0 raises while it decides, the others raise too instead of waiting for its broadcast.
    """
    timer = timer or time_engines
    cache = _CHOICES.setdefault(key, {})
    everywhere = dict(classes)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, classes)
        for other in gathered:
            for shape, count in other.items():
                everywhere[shape] = max(everywhere.get(shape, 0), count)
    table: dict[ShapeClass, str] = {}
    notes: list[str] = []
    error: BaseException | None = None
    if not distributed or dist.get_rank() == 0:
        known = {**cache, **(preset or {})}
        try:
            for m, n in sorted(everywhere):
                if (m, n) in known:
                    table[(m, n)] = known[(m, n)]
                elif m == n:
                    table[(m, n)] = "folded"  # square: Gram runs the folded iteration itself
                elif device.type == "meta":
                    # Nothing to time on meta tensors (a launch count): the rule, as CUDA's.
                    table[(m, n)] = auto_choice((m, n), "meta")
                else:
                    shape = (everywhere[(m, n)], m, n)
                    args = (device, coefficients, eps)
                    table[(m, n)], more = _choose(timer, make, shape, *args)
                    notes += more
        except BaseException as err:
            if not distributed:
                raise
            error = err  # raised after the broadcast, so that no rank waits for it
    if distributed:
        box = [(table, notes, None if error is None else _describe(error))]
        dist.broadcast_object_list(box, src=0)
        table, notes, failure = box[0]
        if error is not None:
            raise error
        if failure is not None:
            raise RuntimeError(
                f'newton_schulz_impl="auto": rank 0 raised while it measured the engines '
                f"({failure}); no rank has a table (see rank 0's error)"
            )
    for note in notes:
        warnings.warn(note, RuntimeWarning, stacklevel=3)
    cache.update(table)  # rank 0's word, also for classes this rank had cached otherwise
    return table


def calibrate_plan(
    batches: Iterable[MuonBatch],
    ns: NewtonSchulzSettings,
    device: torch.device,
    eps: float,
    record: dict | None = None,
) -> tuple[dict[ShapeClass, str], dict]:
    """:func:`calibrate` for an optimizer: its plan's shape classes, candidates built from
    its Newton–Schulz settings, cached under their calibration key. Collective, as
    :func:`calibrate` is.

    ``record``: the optimizer's table so far (:func:`auto_record`; a loaded checkpoint's),
    whose choices rule when it was measured under the same settings. Returns the plan's
    table and the record to keep (``record``'s choices and the new ones).
    """
    settings = _record_settings(ns, device)
    preset = None
    if record is not None and record["settings"] == settings:
        preset = {(m, n): name for m, n, name in record["choices"]}
    table = calibrate(
        plan_shape_classes(batches),
        ns.calibration_key(device),
        lambda name: ns.orthogonalizer(impl=name),
        device,
        ns.coefficients,
        float(eps),
        preset=preset,
    )
    return table, auto_record(settings, {**(preset or {}), **table})


def _record_settings(ns: NewtonSchulzSettings, device: torch.device) -> dict:
    """What a table was measured under, in plain values (a checkpoint loads it with
    ``weights_only=True``): the device type, not its index, so every rank's record is
    alike."""
    return {
        "device_type": device.type,
        "dtype": str(ns.dtype),
        "preconditioner": ns.preconditioner,
        "coefficients": [list(step) for step in ns.coefficients],
        "restarts": None if ns.restarts is None else list(ns.restarts),
        "guard": ns.guard,
    }


def auto_record(settings: dict, choices: dict[ShapeClass, str]) -> dict:
    """``"auto"``'s table as a state dict holds it under :data:`STATE_DICT_KEY`:
    ``{"settings": ..., "choices": [[short, long, engine], ...]}``."""
    rows = [[m, n, name] for (m, n), name in sorted(choices.items())]
    return {"settings": copy.deepcopy(settings), "choices": rows}


def with_auto_record(state_dict: dict, record: dict | None) -> dict:
    """``state_dict`` with a copy of ``record`` under :data:`STATE_DICT_KEY` (``None``:
    unchanged)."""
    if record is not None:
        state_dict[STATE_DICT_KEY] = copy.deepcopy(record)
    return state_dict


def read_auto_record(state_dict: dict) -> dict | None:
    """The table a state dict holds under :data:`STATE_DICT_KEY`, checked (``None``: it has
    none, as dion's and older checkpoints). ValueError naming what is wrong."""
    value = state_dict.get(STATE_DICT_KEY)
    if value is None:
        return None
    label = f"state dict: {STATE_DICT_KEY!r}"
    if not isinstance(value, dict) or set(value) != {"settings", "choices"}:
        got = sorted(map(str, value)) if isinstance(value, dict) else type(value).__name__
        raise ValueError(f"{label} must be a dict with 'settings' and 'choices', got {got}")
    settings, rows = value["settings"], value["choices"]
    if not isinstance(settings, dict) or not isinstance(rows, (list, tuple)):
        raise ValueError(f"{label}: 'settings' must be a dict and 'choices' a list")
    choices: dict[ShapeClass, str] = {}
    for row in rows:
        if not _valid_row(row):
            raise ValueError(
                f"{label}: choice {row!r} is not [short, long, engine] with 0 < short <= long "
                f"and engine one of {list(AUTO_CANDIDATES)} ('folded' when square)"
            )
        choices[(row[0], row[1])] = row[2]
    return auto_record(settings, choices)


def _valid_row(row) -> bool:
    if not isinstance(row, (list, tuple)) or len(row) != 3:
        return False
    m, n, name = row
    sizes = all(isinstance(x, int) and not isinstance(x, bool) for x in (m, n)) and 0 < m <= n
    return sizes and name in AUTO_CANDIDATES and (m != n or name == "folded")
