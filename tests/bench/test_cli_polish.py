"""Issue #20 (6): the command line's rough edges.

Flags: a typo gets "did you mean", an abbreviation is refused. Help: ``--offload`` lists each
choice once, ``--layers N`` says what it does. Messages: ``bench plan``'s mesh errors speak of
its simulated world size, a 2-D layout without ``--mesh`` says which mesh it chose. Progress:
the bar names the phase after the timed steps. Plots: ``bench ns`` tick labels do not collide
and name the device, ``bench ab`` has integer steps and a legend over no line, ``bench plan``
has its ratio line in the legend. ``train --layout fsdp-tp`` prints no FSDP "view tensor"
warning. ``print(opt.last_step_stats)`` reads as a summary. ``--version`` names shardmuon's
version (pyproject's) and torch's.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from cli_walk import all_parsers

from shardmuon.cli import build_parser, main
from shardmuon.runtime.telemetry import StepStats

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    # --threads sets torch's process-wide thread count; keep it from leaking into other tests.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _exit_2(argv, capsys) -> str:
    """Run ``argv``, expect argparse's exit status 2, return stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------ flags


@pytest.mark.parametrize(
    ("argv", "given", "suggested", "usage"),
    [
        (["bench", "step", "--nprc", "2"], "--nprc", "--nproc", "shardmuon bench step"),
        (["bench", "--nprocs", "2"], "--nprocs", "--nproc", "shardmuon bench step"),
        (["bench", "plan", "--world-sizes", "8"], "--world-sizes", "--world-size", "bench plan"),
        (["bench", "ns", "--repeat=3"], "--repeat", "--repeats", "shardmuon bench ns"),
        (["bench", "ab", "--step", "2"], "--step", "--steps", "shardmuon bench ab"),
        (["train", "--nprocs", "2"], "--nprocs", "--nproc", "shardmuon train"),
        (["train", "plot", "a.json", "--plots", "x.png"], "--plots", "--plot", "train plot"),
    ],
)
def test_mistyped_flag_gets_did_you_mean(argv, given, suggested, usage, capsys):
    err = _exit_2(argv, capsys)
    # Reported by the sub-command the flag was given to, with its own usage line.
    assert err.startswith(f"usage: {usage}") or f"usage: shardmuon {usage}" in err, err
    assert f"unrecognized argument {given}; did you mean {suggested}?" in err, err


@pytest.mark.parametrize(
    ("argv", "given"),
    [
        (["bench", "step", "--npr", "2"], "--npr"),
        (["bench", "ns", "--shape", "4x4"], "--shape"),
        (["bench", "plan", "--all"], "--all"),
        (["train", "--check", "ck"], "--check"),
        (["train", "--no-prog"], "--no-prog"),
    ],
)
def test_abbreviations_are_not_accepted(argv, given, capsys):
    err = _exit_2(argv, capsys)
    assert f"unrecognized argument {given}; did you mean" in err, err


def test_an_ambiguous_abbreviation_names_every_flag_it_could_be(capsys):
    err = _exit_2(["bench", "step", "--lay", "2"], capsys)
    assert "unrecognized argument --lay; did you mean --layers or --layout?" in err, err


def test_a_flag_like_none_lists_the_accepted_flags(capsys):
    err = _exit_2(["bench", "ab", "--frobnicate"], capsys)
    line = err.strip().splitlines()[-1]
    assert line.startswith("shardmuon bench ab: error: unrecognized argument --frobnicate;")
    assert "accepted: " in line
    for flag in ("--model", "--layers", "--steps", "--coefficients", "--json", "--no-progress"):
        assert flag in line, flag
    assert "--presets" not in line  # hidden old aliases are not offered


def test_stray_positional_argument_is_reported_by_its_command(capsys):
    err = _exit_2(["bench", "step", "--nproc", "2", "extra"], capsys)
    assert "shardmuon bench step: error: unrecognized argument: extra" in err, err


def test_every_parser_refuses_abbreviations():
    parsers = list(all_parsers(build_parser()))
    names = {p.prog for p in parsers}
    assert {"shardmuon bench step", "shardmuon bench plan", "shardmuon train plot"} <= names
    assert all(p.allow_abbrev is False for p in parsers), [p.prog for p in parsers]


def test_exact_flags_and_equals_values_still_parse():
    args = build_parser().parse_args(["bench", "step", "--nproc=3", "--layout", "hsdp"])
    assert (args.nproc, args.layout) == (3, "hsdp")
    args = build_parser().parse_args(["train", "--no-nesterov", "--layers", "1"])
    assert (args.nesterov, args.num_layers) == (False, 1)


# ------------------------------------------------------------------------------ help


def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_step_help_lists_each_offload_choice_once(capsys):
    text = _help(["bench", "step"], capsys)
    metavars = re.findall(r"--offload (\{[^}]*\})", text)
    assert metavars, text
    for metavar in metavars:
        choices = metavar.strip("{}").split(",")
        assert sorted(choices) == ["none", "state"], metavar


@pytest.mark.parametrize(
    "command", [["bench", "step"], ["bench", "ab"], ["bench", "plan"], ["train"]]
)
def test_layers_help_says_what_it_does(command, capsys):
    text = " ".join(_help(command, capsys).split())
    match = re.search(r"--layers N (.*?) --", text)
    assert match, text
    assert "first N decoder layers" in match.group(1), match.group(1)


# ------------------------------------------------------------------------------ meshes


def test_plan_mesh_error_speaks_of_the_simulated_world_size(capsys):
    argv = ["bench", "plan", "--model", "tiny-moe", "--layout", "hsdp", "--world-size", "8",
            "--mesh", "3x3", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--mesh 3x3 has 9 ranks" in err and "--world-size 8" in err, err
    assert "process" not in err, err


def test_step_mesh_error_names_nproc(capsys):
    assert main(["bench", "step", "--nproc", "3", "--layout", "hsdp", "--mesh", "2x2"]) == 2
    err = capsys.readouterr().err
    assert "--mesh 2x2 has 4 ranks" in err and "--nproc 3" in err, err


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_step_hsdp_without_mesh_says_which_mesh(monkeypatch, capsys):
    import shardmuon.bench.step as step

    monkeypatch.setattr(step, "launch", _stop)
    with pytest.raises(_Stop):
        main(["bench", "step", "--nproc", "4", "--layout", "hsdp", "--no-progress"])
    err = capsys.readouterr().err
    assert (
        "--layout hsdp: mesh 2x2 for --nproc 4 (2 replicas of 2 shards); "
        "--mesh REPLICATExSHARD chooses another"
    ) in err, err
    # Given explicitly, nothing to say.
    with pytest.raises(_Stop):
        main(["bench", "step", "--nproc", "4", "--layout", "hsdp", "--mesh", "1x4"])
    assert "mesh" not in capsys.readouterr().err


def test_plan_hsdp_without_mesh_says_which_meshes(monkeypatch, capsys):
    import shardmuon.bench.plan as plan

    monkeypatch.setattr(plan, "build_meta_model", _stop)
    with pytest.raises(_Stop):
        main(["bench", "plan", "--layout", "hsdp", "--world-size", "8,16", "--no-progress"])
    err = capsys.readouterr().err
    assert (
        "--layout hsdp: mesh 2x4 for 8 ranks (2 replicas of 4 shards), 2x8 for 16 ranks "
        "(2 replicas of 8 shards); --mesh REPLICATExSHARD chooses others"
    ) in err, err


# ------------------------------------------------------------------------------ progress


def test_progress_names_the_replay_and_profiling_phases(monkeypatch):
    from shardmuon.bench import step_worker
    from shardmuon.bench.launch import RankContext

    bars = []
    real_progress = step_worker.new_progress

    def recording_progress(enabled=True):
        bar = real_progress(enabled)
        bars.append(bar)
        return bar

    seen: dict[str, list[str]] = {"replay": [], "profile": []}

    def spy(kind, real):
        def wrapper(*args, **kwargs):
            seen[kind].append(bars[-1].tasks[0].description)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(step_worker, "new_progress", recording_progress)
    monkeypatch.setattr(
        step_worker, "replay_newton_schulz", spy("replay", step_worker.replay_newton_schulz)
    )
    monkeypatch.setattr(
        step_worker, "measure_cpu_step", spy("profile", step_worker.measure_cpu_step)
    )
    cfg = step_worker.StepConfig(
        model="tiny-dense", layers=1, vocab_size=None, layout="none", mesh_shape=None,
        steps=2, impls=("shardmuon",), coefficients="dion", lr=0.02, seed=0, progress=True,
        ns_repeats=1,
    )  # fmt: skip
    step_worker.worker(RankContext(0, 1, torch.device("cpu"), 1, False), cfg)
    (replay,) = seen["replay"]
    (profile,) = seen["profile"]
    assert "shardmuon" in replay and "Newton-Schulz" in replay and "replay" in replay, replay
    assert "shardmuon" in profile and "memory" in profile, profile


# ------------------------------------------------------------------------------ plots


@pytest.fixture
def saved_figures(monkeypatch):
    """Every matplotlib figure saved while the test runs (the one the PNG was made from)."""
    from matplotlib.figure import Figure

    figures = []
    real_savefig = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def _renderer(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # pyplot.close leaves a saved figure on a bare canvas: draw it on an Agg one again.
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _overlapping_x_tick_labels(fig, ax) -> list[tuple[str, str]]:
    renderer = _renderer(fig)
    labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
    boxes = [t.get_window_extent(renderer) for t in labels]
    return [
        (labels[i].get_text(), labels[j].get_text())
        for i, j in itertools.combinations(range(len(labels)), 2)
        if boxes[i].overlaps(boxes[j])
    ]


def _points_in_box(line, box, samples: int = 200) -> int:
    """Points of ``line``'s polyline (sampled densely, display coords) inside ``box``."""
    xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
    xy = xy[np.isfinite(xy).all(axis=1)]
    inside = 0
    for (x0, y0), (x1, y1) in itertools.pairwise(xy):
        t = np.linspace(0.0, 1.0, samples)
        xs, ys = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
        inside += int(np.sum((xs > box.x0) & (xs < box.x1) & (ys > box.y0) & (ys < box.y1)))
    if len(xy) == 1:
        ((x, y),) = xy
        inside += int(box.x0 < x < box.x1 and box.y0 < y < box.y1)
    return inside


def _legends(fig):
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def _legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in _legends(fig) for t in legend.get_texts()]


def test_ns_plot_tick_labels_do_not_collide_and_name_the_device(tmp_path, saved_figures, capsys):
    png = tmp_path / "ns.png"
    shapes = "8x16x1000,8x1000x16,4x24x1200,2x32x2048,16x16x1024,6x20x1536"
    argv = ["bench", "ns", "--shapes", shapes, "--coefficients", "dion,deepseek-v4,keller",
            "--repeats", "1", "--threads", "1", "--device", "cpu", "--plot", str(png),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (fig,) = saved_figures
    ax = fig.axes[0]
    assert len([t for t in ax.get_xticklabels() if t.get_text()]) == 18
    assert _overlapping_x_tick_labels(fig, ax) == []
    ylabel = ax.get_ylabel()
    assert "cpu" in ylabel.lower() and "1 thread" in ylabel, ylabel


def test_ab_plot_has_integer_steps_and_a_legend_over_no_line(tmp_path, saved_figures):
    png = tmp_path / "ab.png"
    argv = ["bench", "ab", "--model", "tiny-dense", "--layers", "1", "--steps", "3",
            "--coefficients", "dion,deepseek-v4,keller", "--threads", "1", "--plot", str(png),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (fig,) = saved_figures
    ax = fig.axes[0]
    renderer = _renderer(fig)
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    lines = [line for line in ax.get_lines() if len(line.get_xdata())]
    assert len(lines) == 10  # 5 variants (3 folded, unfolded, Gram): difference, noise floor
    (legend,) = _legends(fig)
    box = legend.get_window_extent(renderer)
    covered = {line.get_label(): _points_in_box(line, box) for line in lines}
    assert not any(covered.values()), covered


def test_plan_plot_has_the_ratio_line_in_the_legend(tmp_path, saved_figures):
    png = tmp_path / "plan.png"
    argv = ["bench", "plan", "--model", "tiny-moe", "--layers", "2", "--vocab-size", "64",
            "--layout", "ep", "--world-size", "2,4", "--plot", str(png), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (fig,) = saved_figures
    texts = _legend_texts(fig)
    ratio_lines = [line for ax in fig.axes for line in ax.get_lines() if len(line.get_xdata())]
    assert ratio_lines
    for line in ratio_lines:
        assert not line.get_label().startswith("_"), line.get_label()
        assert line.get_label() in texts, (line.get_label(), texts)
    assert {"max", "mean"} <= set(texts), texts
    renderer = _renderer(fig)
    for legend in _legends(fig):
        box = legend.get_window_extent(renderer)
        assert not any(_points_in_box(line, box) for line in ratio_lines)


# ------------------------------------------------------------------------------ train fsdp-tp


@pytest.mark.exhaustive  # a 4-process training run (9 s) for the output's wording
def test_train_fsdp_tp_prints_no_view_tensor_warning(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "shardmuon", "train", "--layout", "fsdp-tp", "--nproc", "4",
         "--model", "tiny-dense", "--steps", "2", "--no-progress"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "view tensor" not in proc.stderr, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr


def test_train_silences_exactly_the_fsdp_view_warning_of_its_model():
    import warnings

    from shardmuon.train import loop

    class Root(torch.nn.Module):
        def forward(self):
            for who in ("Root", "Other"):
                message = f"FSDP2-wrapped module ({who}) returned a view tensor. ..."
                warnings.warn(message, UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loop.ignore_logits_view_warning(Root())
        Root()()
    assert [str(w.message) for w in caught] == [
        "FSDP2-wrapped module (Other) returned a view tensor. ...",
        "another warning",
    ]


# ------------------------------------------------------------------------------ StepStats


def test_step_stats_prints_as_a_readable_summary():
    stats = StepStats(
        bytes_sent=3 * 2**20,
        bytes_received=3 * 2**20,
        bytes_minimum=3 * 2**20,
        num_batches=7,
        matrices_orthogonalized=2000,
        owned_shapes=[(1024, 4096)] * 1000 + [(4096, 1024)] * 1000,
        ns_calls=[(8, 1024, 4096)] * 500,
        workspace_peak_bytes=512 * 2**20,
    )
    text = str(stats)
    lines = text.splitlines()
    assert 3 <= len(lines) <= 12, text
    assert all(len(line) <= 100 for line in lines), text
    assert "3.00 MiB" in text and "512 MiB" in text, text
    assert "2000 matrices" in text and "7 batches" in text and "500 Newton-Schulz calls" in text, (
        text
    )
    assert "1000 x (1024, 4096)" in text, text
    assert "(1024, 4096), (1024, 4096)" not in text  # not the raw list
    # Offload and replica lines only when there was such traffic.
    assert "offload" not in text and "replica" not in text
    offloaded = str(StepStats(offload_bytes_loaded=2048, offload_bytes_stored=1024))
    assert "offload" in offloaded and "2.00 KiB" in offloaded, offloaded
    # repr stays one line and short, with every scalar field.
    short = repr(stats)
    assert "\n" not in short and len(short) < 500, short
    assert "bytes_sent=3145728" in short and "owned_shapes=<2000 shapes>" in short, short


def test_a_real_steps_stats_print_readably(capsys):
    from shardmuon import Muon

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in [(16, 8), (16, 8), (8, 24)]]
    opt = Muon([{"params": params, "algorithm": "muon"}], lr=0.02)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    print(opt.last_step_stats)
    text = capsys.readouterr().out
    assert "orthogonalized: 3 matrices" in text, text
    assert "2 x (16, 8), 1 x (8, 24)" in text, text
    assert "non-finite matrices skipped: 0" in text, text


def test_train_fsdp_tp_without_mesh_says_which_mesh(monkeypatch, capsys):
    import shardmuon.train.cli as train_cli

    monkeypatch.setattr(train_cli, "run_training", _stop)
    with pytest.raises(_Stop):
        main(["train", "--layout", "fsdp-tp", "--nproc", "4", "--model", "tiny-dense"])
    err = capsys.readouterr().err
    assert (
        "--layout fsdp-tp: mesh 2x2 for --nproc 4 (FSDP over 2, tensor parallel over 2); "
        "--mesh DPxTP chooses another"
    ) in err, err


# ------------------------------------------------------------------------------ version


def _pyproject_version() -> str:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return re.search(r'^version = "([^"]+)"', text, re.MULTILINE).group(1)
    return tomllib.loads(text)["project"]["version"]


def test_version_prints_shardmuon_and_torch_versions(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    captured = capsys.readouterr()
    assert captured.out == f"shardmuon {_pyproject_version()} (torch {torch.__version__})\n"
    assert captured.err == ""
    assert "--version" in build_parser().format_help()


@pytest.mark.parametrize("how", ["module", "script"])
def test_version_from_the_command_line_exits_0(how, tmp_path):
    if how == "module":
        command = [sys.executable, "-m", "shardmuon"]
    else:
        script = Path(sys.executable).with_name("shardmuon")
        if not script.exists():
            pytest.skip(f"no shardmuon script beside {sys.executable}")
        command = [str(script)]
    proc = subprocess.run(
        [*command, "--version"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"shardmuon {_pyproject_version()} (torch {torch.__version__})\n"


def test_version_is_pyprojects_installed_or_not(monkeypatch):
    import importlib.metadata

    import shardmuon

    # Installed: the distribution's metadata (a stale editable install fails here: reinstall).
    assert shardmuon.__version__ == _pyproject_version()

    # A source tree on the path without an install: read from pyproject.toml.
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert shardmuon._version() == _pyproject_version()
