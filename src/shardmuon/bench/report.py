"""Output of the benchmarks: rich tables, JSON with the environment, matplotlib plots, progress.

Tables go to stdout; progress bars and notes go to stderr so that stdout stays the result.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

# Tables are laid out to fit this many columns when stdout is not a terminal.
TABLE_WIDTH = 80

__all__ = [
    "TABLE_WIDTH",
    "environment",
    "fmt",
    "new_progress",
    "print_legend",
    "print_table",
    "repeat_times",
    "set_threads",
    "spread",
    "synchronize",
    "write_json",
    "write_outputs",
]


def _console(stderr: bool, width: int | None = None):
    from rich.console import Console

    console = Console(stderr=stderr, highlight=False, width=width)
    if width is None and not console.is_terminal:
        # Piped or captured output (a log, a CI job) is read at the common 80 columns.
        console = Console(stderr=stderr, highlight=False, width=TABLE_WIDTH)
    return console


def stderr_console():
    """A rich console on stderr, for notes and progress."""
    return _console(stderr=True)


def environment(
    world_size: int = 1, threads: int | None = None, argv: Sequence[str] | None = None
) -> dict[str, Any]:
    """What a figure depends on: versions, device, threads, world size, command line, date.

    ``argv``: the arguments after the program name (default ``sys.argv[1:]``).
    """
    import shardmuon

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
        device_type = "cuda"
    else:
        device = platform.processor() or platform.machine()
        device_type = "cpu"
    return {
        "shardmuon": shardmuon.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device_type": device_type,
        "device": device,
        "cpu_count": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "world_size": world_size,
        "command": shlex.join(["shardmuon", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (non-finite floats become ``null``); returns the path.

    Check the path with :func:`shardmuon.harness.cli_support.check_output_file` before the work.
    """
    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")
    return out


def fmt(value: float | None, spec: str = ".3g", suffix: str = "") -> str:
    """Format a number for a table cell; ``None`` / NaN show as ``-``."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def title_lines(title: str, width: int = TABLE_WIDTH) -> list[str]:
    """``title`` in lines of at most ``width`` characters, broken only between its
    comma-separated phrases (a phrase longer than the width keeps a line of its own)."""
    lines: list[str] = []
    for phrase in title.split(", "):
        if lines and len(lines[-1]) + 2 + len(phrase) <= width:
            lines[-1] += ", " + phrase
        else:
            if lines:
                lines[-1] += ","
            lines.append(phrase)
    return lines


def _rich_table(columns: Sequence[str], rows: Sequence[Sequence[str]], keep: Sequence[int]):
    """The rich table of ``columns[i]`` (and each row's cell i) for i in ``keep``."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for position, i in enumerate(keep):
        widest = max((len(line) for line in columns[i].split("\n")), default=0)
        table.add_column(
            columns[i],
            justify="left" if position == 0 else "right",
            no_wrap=True,
            min_width=widest,
        )
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    caption: str | None = None,
    legend: Sequence[tuple[str, str]] = (),
) -> None:
    """Print a compact rich table to stdout, then ``caption`` and one line per ``legend`` entry.

    The first column is left-aligned, the rest right-aligned. Nothing breaks mid-phrase: the
    title wraps only between its comma-separated phrases, a header only where it has a
    ``"\\n"`` (each column is at least as wide as its longest header line) and cells never
    (a number broken over two lines misreads). A table wider than the console is printed as
    several, each with the first column and as many of the next as fit. ``legend`` is
    ``(column, meaning)`` pairs: what each column means, under the table.
    """
    rows = [list(row) for row in rows]
    console = _console(stderr=False)
    wide = console.options.update(max_width=10**4)

    def width(keep: list[int]) -> int:
        return console.measure(_rich_table(columns, rows, keep), options=wide).maximum

    parts: list[list[int]] = [[]]
    for i in range(1, len(columns)):
        if parts[-1] and width([0, *parts[-1], i]) > console.width:
            parts.append([])
        parts[-1].append(i)
    for line in title_lines(title, console.width):
        # soft_wrap: rich itself must not break a phrase longer than the console.
        console.print(line, style="italic", markup=False, highlight=False, soft_wrap=True)
    for part in parts:
        console.print(_rich_table(columns, rows, [0, *part]))
    print_legend(legend, caption)


def print_legend(legend: Sequence[tuple[str, str]], caption: str | None = None) -> None:
    """Print ``caption``, then ``column: meaning`` for each ``legend`` pair, to stdout."""
    console = _console(stderr=False)
    if caption:
        console.print(caption, markup=False)
    for name, meaning in legend:
        console.print(f"  {name.replace(chr(10), ' ')}: {meaning}", markup=False)
    if caption or legend:
        console.print()  # apart from what follows


def new_progress(enabled: bool = True):
    """A rich progress bar on stderr (a no-op context when ``enabled`` is false).

    Use as ``with new_progress() as progress: task = progress.add_task(...)``; when
    disabled, the returned object is ``None``.
    """
    if not enabled:
        return nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=stderr_console(),
        transient=True,
    )


def set_threads(threads: int | None) -> None:
    """Set torch's intra-op threads (``None``: leave torch's default); ``ValueError`` if < 1
    or more than the cores can use (:func:`shardmuon.harness.processes.check_thread_count`)."""
    from shardmuon.harness.processes import check_thread_count

    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    check_thread_count(threads)
    torch.set_num_threads(threads)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock time covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def repeat_times(
    fn: Callable[[], Any],
    device: torch.device,
    repeats: int,
    warmup: int = 1,
    before: Callable[[], Any] | None = None,
) -> list[float]:
    """Wall-clock seconds of each of ``repeats`` calls of ``fn()``, after ``warmup`` calls.

    ``before()`` (a barrier across ranks, say) runs untimed before every call, warm-up
    calls included, so that every rank makes the same number of them.
    """
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def spread(values: Sequence[float]) -> dict[str, float]:
    """``min``, ``q1``, ``median``, ``q3`` and ``max`` of ``values`` (quartiles inclusive)."""
    values = sorted(values)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "min": values[0],
        "q1": q1,
        "median": statistics.median(values),
        "q3": q3,
        "max": values[-1],
    }


def write_outputs(
    args,
    benchmark: str,
    payload: dict[str, Any],
    draw: Callable[[Any], None],
    title: str,
    **env: Any,
) -> None:
    """Write a benchmark's ``--json`` and ``--plot`` files (when asked for), each announced.

    The JSON holds ``benchmark``, the :func:`environment` (``env``: its ``world_size`` and
    ``threads``) and ``payload``; the plot is ``draw(ax)`` under ``title``.
    """
    from shardmuon.harness.cli_support import note_written

    if args.json:
        environ = environment(argv=getattr(args, "argv", None), **env)
        write_json(args.json, {"benchmark": benchmark, "environment": environ, **payload})
        note_written(args.json, "results (JSON)")
    if args.plot:
        save_plot(args.plot, draw, title)
        note_written(args.plot, "plot (PNG)")


def plot_figure(draw: Callable[[Any], None], title: str):
    """The figure :func:`save_plot` writes: ``draw(ax)`` on a fresh Agg figure, ``title`` on top.

    Laid out by matplotlib's constrained layout, so that a legend placed with
    ``ax.figure.legend(loc="outside right upper")`` sits beside the axes, over no data. The
    x tick labels are then turned upright and shrunk, as far as needed, so that no two
    overlap (long shape or implementation names under many bars). Close it with
    ``matplotlib.pyplot.close``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    try:
        draw(ax)
        ax.set_title(title)
        separate_x_tick_labels(ax)
    except BaseException:
        plt.close(fig)
        raise
    return fig


def overlapping_x_tick_labels(ax) -> list[tuple[str, str]]:
    """Pairs of ``ax``'s x tick labels whose boxes overlap, as the figure is now laid out."""
    fig = ax.figure
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    return [
        (labels[i].get_text(), labels[j].get_text())
        for i in range(len(labels))
        for j in range(i + 1, len(labels))
        if boxes[i].overlaps(boxes[j])
    ]


def separate_x_tick_labels(ax) -> None:
    """Turn ``ax``'s x tick labels upright, then shrink them, until no two overlap.

    Labels that fit side by side are left as they are; the last setting (upright, 5 pt)
    is kept if even that does not fit.
    """
    if not overlapping_x_tick_labels(ax):
        return
    for size in (None, 7, 6, 5):
        ax.tick_params(axis="x", labelrotation=90, **({"labelsize": size} if size else {}))
        if not overlapping_x_tick_labels(ax):
            return


def save_plot(path: str | os.PathLike, draw: Callable[[Any], None], title: str) -> Path:
    """Save :func:`plot_figure` of ``draw`` and ``title`` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    out = Path(path)
    if out.parent and not out.parent.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
    fig = plot_figure(draw, title)
    try:
        fig.savefig(out, format="png", dpi=120)
    finally:
        plt.close(fig)
    return out
