"""Issue #28 (5): the command line never runs away and never tracebacks on a number.

Process counts are checked against what the machine holds before any process starts (one
shared check, used by ``bench`` and ``train``); every numeric flag of every command refuses
nan, inf, out-of-range values and words in one line while the arguments are parsed; a
mistyped sub-command gets "did you mean"; fp16 on a CPU without native fp16 GEMMs is
announced before the run; ``--ns-impl`` does not run one configuration twice.

Nothing here starts a process or runs a benchmark: every entry to the work is replaced by a
function that fails the test (``no_work``), and the refusals are checked before it.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from shardmuon.cli import build_parser, main

GIB = 2**30


class _Stop(Exception):
    """Raised by a stand-in for the work: the command got past its checks."""


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Make every way of starting processes or work fail the test."""
    import torch.multiprocessing as mp

    import shardmuon.bench.ab as ab
    import shardmuon.bench.ns as ns
    import shardmuon.bench.plan as plan
    import shardmuon.bench.step as step
    from shardmuon.train import run as train_run

    def forbidden(*args, **kwargs):
        raise AssertionError("work or processes were started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", forbidden)
    monkeypatch.setattr(mp, "start_processes", forbidden)
    monkeypatch.setattr(step, "launch", forbidden)
    monkeypatch.setattr(ns, "measure_shape", forbidden)
    monkeypatch.setattr(ns, "input_and_reference", forbidden)
    monkeypatch.setattr(ab, "_Setup", forbidden)
    monkeypatch.setattr(plan, "build_meta_model", forbidden)
    monkeypatch.setattr(train_run, "train_on_rank", forbidden)
    monkeypatch.setattr(train_run, "spawn_training", forbidden)
    monkeypatch.setattr(train_run, "prepare_resume", forbidden)
    monkeypatch.delenv("SHARDMUON_MAX_NPROC", raising=False)
    # The machine's cores and memory are the limit here, not its GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _exit_2(argv, capsys) -> str:
    """Run ``argv`` through the CLI; it must exit 2 (raised or returned); stderr, stripped."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2, argv
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err


def _one_line(argv, capsys) -> str:
    err = _exit_2(argv, capsys)
    assert "\n" not in err, err
    return err


# ------------------------------------------------------------------- every numeric flag


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def _numeric_flags() -> list[tuple[list[str], str, object]]:
    """``(sub-command words, flag, type)`` of every option whose value is one number."""
    from shardmuon.harness.cli_support import Number

    out = []
    for parser in _parsers(build_parser()):
        words = parser.prog.split()[1:]
        for action in parser._actions:
            if action.option_strings and (
                action.type in (int, float) or isinstance(action.type, Number)
            ):
                for flag in action.option_strings:
                    out.append((words, flag, action.type))
    return out


def _bad_values(kind) -> list[str]:
    """Values ``kind`` (an argparse type) must refuse: words, nan, inf, out of range."""
    if kind is int:
        return ["garbage", "nan", "inf", "1.5"]
    if kind is float:
        return ["garbage", "nan", "inf", "-inf"]
    values = ["garbage", "nan", "inf", "-inf"]
    if kind.kind is int:
        values.append("1.5")
    if kind.low is not None:
        values.append(f"{kind.low:g}" if kind.low_open else f"{kind.low - 1:g}")
    if kind.high is not None:
        values.append(f"{kind.high:g}" if kind.high_open else str(int(kind.high) + 1))
    return values


NUMERIC_FLAGS = _numeric_flags()


def test_every_numeric_flag_takes_a_checked_number():
    # int / float accept nan, inf and any range: every numeric flag takes a checked Number.
    bare = [(" ".join(w), f) for w, f, kind in NUMERIC_FLAGS if kind in (int, float)]
    assert bare == []
    seen = {(" ".join(words), flag) for words, flag, _ in NUMERIC_FLAGS}
    for expected in [
        ("bench step", "--lr"),
        ("bench step", "--nproc"),
        ("bench ns", "--repeats"),
        ("bench ab", "--steps"),
        ("bench plan", "--vocab-size"),
        ("train", "--nproc"),
        ("train", "--mu"),
        ("train", "--num-layers"),  # hidden old aliases too
    ]:
        assert expected in seen, expected
    # Good numbers still parse, to the same values.
    args = build_parser().parse_args(["bench", "step", "--lr", "1e-3", "--seed=0", "--steps", "2"])
    assert (args.lr, args.seed, args.steps) == (1e-3, 0, 2)
    args = build_parser().parse_args(["train", "--mu", "0", "--weight-decay", "0", "--layers", "1"])
    assert (args.mu, args.weight_decay, args.num_layers) == (0.0, 0.0, 1)


@pytest.mark.parametrize(
    ("words", "flag", "kind"),
    NUMERIC_FLAGS,
    ids=[f"{' '.join(w)} {f}" for w, f, _ in NUMERIC_FLAGS],
)
def test_every_numeric_flag_refuses_bad_numbers_in_one_line(words, flag, kind, capsys):
    prog = " ".join(["shardmuon", *words])
    for value in _bad_values(kind):
        # FLAG=VALUE: "-inf" after a space would be taken for a flag.
        err = _one_line([*words, f"{flag}={value}"], capsys)
        assert err.startswith(f"{prog}: error: {flag} must be "), err
        assert ", got " in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "step", "--lr", "nan"], "bench step: error: --lr must be a finite number > 0, got nan"),
        (["bench", "step", "--lr=inf"], "bench step: error: --lr must be a finite number > 0, got inf"),
        (["bench", "step", "--steps", "1"], "bench step: error: --steps must be an int >= 2, got 1"),
        (["bench", "ab", "--lr", "1e400"], "--lr must be a finite number > 0, got 1e400 (overflows to inf)"),
        (["bench", "ns", "--repeats", "two"], "bench ns: error: --repeats must be an int >= 1, got 'two'"),
        (["bench", "plan", "--layers", "0"], "bench plan: error: --layers must be an int >= 1, got 0"),
        (["train", "--mu", "1"], "train: error: --mu must be in [0, 1), got 1.0"),
        (["train", "--qk-clip-alpha", "1.5"], "train: error: --qk-clip-alpha must be in [0, 1], got 1.5"),
        (["train", "--seed", "-1"], "train: error: --seed must be an int in [0, 2**64), got -1"),
        (["train", "--checkpoint-every", "-1"], "--checkpoint-every must be an int >= 0, got -1"),
    ],
)  # fmt: skip
def test_bad_numbers_say_what_was_given_and_what_is_accepted(argv, message, capsys):
    assert message in _one_line(argv, capsys)


def test_python_m_shardmuon_train_returns_2_on_a_bad_number(capsys):
    from shardmuon.train.cli import main as train_main

    assert train_main(["--min-len=nan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "shardmuon train: error: --min-len must be an int >= 1, got 'nan'"


# ------------------------------------------------------------------- process counts


def test_the_process_limit_rule():
    from shardmuon.harness.processes import process_limit

    # The tests' 8 ranks fit on a 2-core, 24 GiB machine.
    assert process_limit(cores=2, available_bytes=24 * GIB, environ={}).limit == 8
    assert process_limit(cores=16, available_bytes=128 * GIB, environ={}).limit == 64
    # Beyond 8, memory limits too: ~512 MiB a rank.
    assert process_limit(cores=16, available_bytes=6 * GIB, environ={}).limit == 12
    # Up to 8 always start: another job's moment of high memory refuses no small run.
    assert process_limit(cores=16, available_bytes=GIB // 10, environ={}).limit == 8
    assert process_limit(cores=1, available_bytes=None, environ={}).limit == 8
    forced = process_limit(cores=2, available_bytes=24 * GIB, environ={"SHARDMUON_MAX_NPROC": "32"})
    assert (forced.limit, forced.forced) == (32, True)
    with pytest.raises(ValueError, match="SHARDMUON_MAX_NPROC='lots': accepted: an int >= 1"):
        process_limit(environ={"SHARDMUON_MAX_NPROC": "lots"})


def test_the_refusal_names_the_ask_the_machine_and_the_override():
    from shardmuon.harness.processes import check_process_count, process_limit

    limit = process_limit(cores=2, available_bytes=24 * GIB, environ={})
    check_process_count(8, limit=limit)
    with pytest.raises(ValueError) as exc:
        check_process_count(100000, limit=limit)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("--nproc 100000: more processes than this machine holds")
    assert (
        "(2 cores, 24.0 GiB available memory: at most 8 = max(8, min(8 by cores at 4 per core, 48 by memory"
        in message
    )
    assert "give --nproc 8 or fewer, or set SHARDMUON_MAX_NPROC=100000" in message
    forced = process_limit(cores=2, available_bytes=24 * GIB, environ={"SHARDMUON_MAX_NPROC": "3"})
    with pytest.raises(ValueError, match="--nproc 4: more processes than SHARDMUON_MAX_NPROC=3"):
        check_process_count(4, limit=forced)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "step", "--nproc", "100000"],
        ["bench", "--nproc", "100000", "--layout", "none"],
        ["train", "--nproc", "100000", "--batch-size", "100000"],
    ],
)
def test_commands_refuse_more_processes_than_the_machine_holds(argv, capsys):
    err = _one_line(argv, capsys)
    assert "--nproc 100000: more processes than this machine holds" in err, err
    assert "SHARDMUON_MAX_NPROC=100000" in err, err


def test_the_override_raises_the_limit_and_is_checked(monkeypatch, capsys):
    import shardmuon.bench.step as step

    monkeypatch.setenv("SHARDMUON_MAX_NPROC", "2")
    assert "more processes than SHARDMUON_MAX_NPROC=2" in _one_line(
        ["bench", "step", "--nproc", "3", "--layout", "none"], capsys
    )
    monkeypatch.setenv("SHARDMUON_MAX_NPROC", "0")
    assert "SHARDMUON_MAX_NPROC='0': accepted: an int >= 1" in _one_line(
        ["bench", "step", "--nproc", "2"], capsys
    )
    # Raised, it lets more through than the machine's own limit (nothing is started here).
    monkeypatch.setenv("SHARDMUON_MAX_NPROC", "100000")
    started = []

    def fake_launch(body, cfg, world, **kwargs):
        started.append(world)
        raise _Stop

    monkeypatch.setattr(step, "launch", fake_launch)
    with pytest.raises(_Stop):
        main(["bench", "step", "--nproc", "64", "--layout", "fsdp", "--no-progress"])
    assert started == [64]


def test_the_launchers_themselves_refuse_before_spawning():
    from shardmuon.bench.launch import launch
    from shardmuon.train import TrainConfig
    from shardmuon.train.launch import spawn_training

    with pytest.raises(ValueError, match="--nproc 100000: more processes than"):
        launch(print, None, 100000)
    with pytest.raises(ValueError, match="--nproc 100000: more processes than"):
        spawn_training(TrainConfig(nproc=100000, batch_size=100000), None)
    with pytest.raises(ValueError, match="--nproc 100000: more processes than"):
        TrainConfig(nproc=100000, batch_size=100000).validate()


@pytest.mark.parametrize("command", [["bench", "step"], ["train"]])
def test_help_states_the_process_rule(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "at most max(8, min(4 per core, 1 per 512 MiB of available memory))" in text
    assert "SHARDMUON_MAX_NPROC=N allows N" in text


def test_threads_are_bounded_by_the_cores(monkeypatch, capsys):
    from shardmuon.bench.report import set_threads
    from shardmuon.harness.processes import check_thread_count

    check_thread_count(8, cores=2)
    with pytest.raises(ValueError, match="--threads 9: more threads than this machine's 2 cores"):
        check_thread_count(9, cores=2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    with pytest.raises(ValueError, match="--threads 100000: more threads"):
        set_threads(100000)
    assert set_to == []
    assert "--threads 100000: more threads" in _one_line(
        ["bench", "step", "--threads", "100000"], capsys
    )


# ------------------------------------------------------------------- sub-command typos


@pytest.mark.parametrize(
    ("argv", "given", "meant"),
    [
        (["bench", "stpe", "--no-progress"], "stpe", "step"),
        (["bench", "nss"], "nss", "ns"),
        (["trian"], "trian", "train"),
        (["trian", "--nproc", "2"], "trian", "train"),
        (["bench", "pl"], "pl", "plan"),
    ],
)
def test_a_mistyped_subcommand_gets_did_you_mean(argv, given, meant, capsys):
    line = _exit_2(argv, capsys).splitlines()[-1]
    assert f"invalid choice: '{given}'" in line, line
    assert line.endswith(f"; did you mean {meant}?"), line
    assert "unrecognized argument" not in line, line


def test_an_unknown_subcommand_is_named_not_the_flag_after_it(capsys):
    line = _exit_2(["bench", "frobnicate", "--no-progress"], capsys).splitlines()[-1]
    assert "invalid choice: 'frobnicate'" in line, line
    assert "--no-progress" not in line, line


# ------------------------------------------------------------------- fp16 on CPUs


X86_CPUINFO = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16\n"
)
ARM_CPUINFO = "processor\t: 0\nFeatures\t: fp asimd evtstrm asimdhp cpuid\n"


def test_cpu_flags_and_native_fp16_gemms():
    from shardmuon.harness.machine import cpu_flags, native_fp16_gemms

    x86 = cpu_flags(X86_CPUINFO)
    assert {"avx2", "avx512_bf16"} <= x86
    assert native_fp16_gemms(x86) is False
    assert native_fp16_gemms(cpu_flags(X86_CPUINFO.replace("avx2", "avx2 avx512_fp16"))) is True
    assert native_fp16_gemms(cpu_flags(X86_CPUINFO.replace("avx2", "amx_fp16"))) is True
    assert native_fp16_gemms(cpu_flags(ARM_CPUINFO)) is True
    assert cpu_flags("processor\t: 0\n") is None
    assert native_fp16_gemms(None) is None


@pytest.fixture
def cpu_without_fp16(monkeypatch):
    import shardmuon.harness.machine as common

    flags = frozenset({"avx2", "avx512_bf16"})
    monkeypatch.setattr(common, "cpu_flags", lambda: flags, raising=False)


def test_step_fp16_on_such_a_cpu_says_so_before_running(cpu_without_fp16, monkeypatch, capsys):
    import shardmuon.bench.step as step

    before_work = []

    def stop(*args, **kwargs):
        # What was said before the work started.
        before_work.append(capsys.readouterr().err)
        raise _Stop

    monkeypatch.setattr(step, "launch", stop)
    argv = ["bench", "step", "--nproc", "1", "--layout", "none", "--ns-dtype"]
    for dtype in ("fp16", "bf16"):
        with pytest.raises(_Stop):
            main([*argv, dtype])
    fp16, bf16 = before_work
    assert "bench step: note: --ns-dtype fp16 on a CPU without native fp16 GEMMs" in fp16, fp16
    assert "fp16" not in bf16, bf16


def test_the_fp16_note_names_the_isa_and_the_slowdown():
    from shardmuon.harness.machine import fp16_cpu_note

    text = fp16_cpu_note("--ns-dtype fp16", frozenset({"avx2"}))
    assert "\n" not in text
    assert "avx512_fp16" in text and "amx_fp16" in text and "/proc/cpuinfo" in text
    assert "slower than bf16" in text
    assert fp16_cpu_note("--ns-dtype fp16", frozenset({"avx512_fp16"})) is None


def test_ns_fp16_on_such_a_cpu_says_so_before_running(cpu_without_fp16, monkeypatch, capsys):
    import shardmuon.bench.ns as ns

    def stop(*args, **kwargs):
        assert "--dtypes with fp16 on a CPU without native fp16 GEMMs" in capsys.readouterr().err
        raise _Stop

    monkeypatch.setattr(ns, "input_and_reference", stop)
    with pytest.raises(_Stop):
        main(["bench", "ns", "--device", "cpu", "--dtypes", "bf16,fp16", "--no-progress"])


# ------------------------------------------------------------------- no duplicate rows


def test_ns_impl_drops_impls_that_become_the_same_configuration():
    from shardmuon.bench.step import drop_duplicate_configs

    kept, dropped = drop_duplicate_configs(
        ["shardmuon", "shardmuon-gram", "shardmuon-no-rotation", "adamw", "shardmuon-unfolded"],
        {"newton_schulz_impl": "gram"},
        "--ns-impl gram",
    )
    assert kept == ["shardmuon", "shardmuon-no-rotation", "adamw"]
    assert dropped == {
        "shardmuon-gram": "runs the same configuration as shardmuon under --ns-impl gram",
        "shardmuon-unfolded": "runs the same configuration as shardmuon under --ns-impl gram",
    }
    # Without an override every engine is its own configuration.
    kept, dropped = drop_duplicate_configs(["shardmuon", "shardmuon-gram"], {}, "")
    assert (kept, dropped) == (["shardmuon", "shardmuon-gram"], {})


def test_step_runs_each_configuration_once(monkeypatch):
    import shardmuon.bench.step as step

    configs = []

    def record(body, cfg, world, **kwargs):
        configs.append(cfg)
        raise _Stop

    monkeypatch.setattr(step, "launch", record)
    argv = ["bench", "step", "--nproc", "1", "--layout", "none", "--no-progress"]
    argv += ["--impl", "shardmuon,shardmuon-gram"]
    for extra in (["--ns-impl", "gram"], ["--ns-impl", "folded"], []):
        with pytest.raises(_Stop):
            main([*argv, *extra])
    # Under --ns-impl both rows would be one configuration; without it, two engines.
    assert [cfg.impls for cfg in configs] == [
        ("shardmuon",),
        ("shardmuon",),
        ("shardmuon", "shardmuon-gram"),
    ]
