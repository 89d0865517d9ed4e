"""The ``shardmuon`` command line and its building blocks (models, layouts, CPU memory).

Each benchmark runs at a tiny size and its JSON is checked against figures computed here
independently (parameter counts, bf16 byte counts, known allocation sizes). No timing is
asserted: only that times are finite and positive.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from shardmuon.bench import SUBCOMMANDS
from shardmuon.bench.memory import live_bytes, measure_cpu_step, peak_of_events
from shardmuon.bench.report import TABLE_WIDTH
from shardmuon.cli import _default_bench_command, build_parser, main
from shardmuon.harness.models import MODEL_PRESETS, build_model, param_shapes
from shardmuon.harness.parallel import plan_layout
from shardmuon.ops.newton_schulz_gram import gram_flops, standard_flops

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    # --threads sets torch's process-wide thread count; keep it from leaking into other tests.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_environment(env: dict, world_size: int) -> None:
    for key in ("torch", "device_type", "device", "threads", "world_size", "command", "date"):
        assert key in env, key
    assert env["torch"] == torch.__version__
    assert env["world_size"] == world_size
    assert env["command"].startswith("shardmuon bench")


# ------------------------------------------------------------------------------ commands


def _check_printed_table(text: str, legend: list[str]) -> None:
    """The table fits 80 columns and explains its columns underneath."""
    lines = text.splitlines()
    assert lines, "no table printed"
    too_wide = [line for line in lines if len(line.rstrip()) > TABLE_WIDTH]
    assert not too_wide, too_wide
    for entry in legend:
        assert any(line.strip().startswith(f"{entry}:") for line in lines), entry


def test_ns_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "ns.json", tmp_path / "ns.png"
    rc = main(
        ["bench", "ns", "--shapes", "3x16x40,40x24", "--coefficients", "dion,deepseek-v4",
         "--dtypes", "bf16,fp32", "--repeats", "1", "--threads", "1", "--json", str(out),
         "--plot", str(png), "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr()
    _check_printed_table(printed.out, ["speed-up", "TFLOP/s", "of GEMM", "err"])
    assert printed.err.splitlines() == [
        f"wrote results (JSON): {out}",
        f"wrote plot (PNG): {png}",
    ]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "ns"
    _check_environment(data["environment"], world_size=1)
    rows = data["results"]
    assert [(r["shape"], r["preset"]) for r in rows] == [
        ([3, 16, 40], "dion"),
        ([40, 24], "dion"),
        ([3, 16, 40], "deepseek-v4"),
        ([40, 24], "deepseek-v4"),
    ]
    for r in rows:
        assert r["iterations"] == {"dion": 5, "deepseek-v4": 10}[r["preset"]]
        for key in ("folded_ms", "unfolded_ms", "speedup", "folded_tflops", "gemm_tflops"):
            assert _finite_positive(r[key]), (key, r[key])
        # Both are bf16 approximations of the fp64 iteration: close, but not exact.
        assert 0 < r["rel_error_folded"] < 0.05
        assert 0 < r["rel_error_unfolded"] < 0.05
    # FLOPs per call, counted by hand for 3 matrices 16x40 (m=16, n=40), 5 iterations.
    first = rows[0]
    flops = 3 * 5 * (4 * 16 * 16 * 40 + 2 * 16**3)
    assert first["folded_tflops"] == pytest.approx(flops / (first["folded_ms"] / 1e3) / 1e12)
    # One standard-vs-Gram row per shape, preset and dtype, FLOPs counted from the shapes.
    engines = data["engines"]
    assert [(r["shape"], r["preset"], r["dtype"]) for r in engines] == [
        (shape, preset, dtype)
        for preset in ("dion", "deepseek-v4")
        for shape in ([3, 16, 40], [40, 24])
        for dtype in ("bf16", "fp32")
    ]
    for r in engines:
        m, n = sorted(r["shape"][-2:])
        batch = r["shape"][0] if len(r["shape"]) == 3 else 1
        steps = {"dion": 5, "deepseek-v4": 10}[r["preset"]]
        assert r["standard_flops"] == batch * standard_flops(m, n, steps)
        assert r["gram_flops"] == batch * gram_flops(m, n, steps, r["gram_restarts"])
        assert r["gram_flops_ratio"] < 1
        # Every input kind, each checked by the guard; none diverges with the defaults.
        assert [e["kind"] for e in r["errors"]] == ["gaussian", "logspaced", "lowrank"]
        for e in r["errors"]:
            assert e["guard_checked"] == batch and e["guard_fallbacks"] == 0, e
            # fp32 is ~1e-5 from the fp64 iteration; bf16 ~1e-2 on Gaussian inputs, up to 0.5 on
            # these tiny ill-conditioned ones (rounding of amplified small singular values).
            bound = 1e-4 if r["dtype"] == "fp32" else 1.0
            assert 0 < e["standard"] < bound and 0 < e["gram"] < bound, e
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_step_fsdp_two_ranks_moves_the_minimum_bytes(tmp_path, capsys):
    out, png = tmp_path / "step.json", tmp_path / "step.png"
    rc = main(
        ["bench", "step", "--nproc", "2", "--layout", "fsdp", "--model", "tiny-dense",
         "--steps", "2", "--impl", "shardmuon,adamw", "--json", str(out), "--plot", str(png),
         "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr()
    _check_printed_table(
        printed.out,
        ["step ms", "first step ms", "own NS ms", "step ÷ NS", "peak GiB", "all-to-all GB/rank",
         "a2a ÷ min"],
    )  # fmt: skip
    assert f"wrote results (JSON): {out}" in printed.err
    assert f"wrote plot (PNG): {png}" in printed.err
    data = json.loads(out.read_text())
    _check_environment(data["environment"], world_size=2)
    assert data["config"]["mesh_shape"] == [2]
    rows = {r["impl"]: r for r in data["results"]}
    assert set(rows) == {"shardmuon", "adamw"}
    for r in rows.values():
        (steps,) = r["step_times_s"]  # one pass (sequential order), two steps
        assert len(steps) == 2
        assert all(_finite_positive(t) for t in steps)
        assert _finite_positive(r["step_s"])
        assert r["first_step_s"] == steps[0]
        assert r["peak_bytes"] >= r["transient_bytes"] > 0
    sm = rows["shardmuon"]
    assert sm["a2a_over_minimum"] == 1.0
    # Independent count: tiny-dense's Muon matrices all have even rows, so Shard(0) over 2
    # ranks halves each; one half goes to the owner and comes back, in bf16 (2 bytes).
    muon_numel = sum(
        math.prod(shape)
        for name, shape in param_shapes("tiny-dense").items()
        if len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name
    )
    assert sum(sm["bytes_sent"]) == sum(sm["bytes_minimum"]) == 2 * muon_numel
    assert sum(sm["bytes_received"]) == sum(sm["bytes_sent"])
    assert sum(sm["matrices_orthogonalized"]) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert _finite_positive(sm["owned_ns_s"]) and _finite_positive(sm["step_over_ns"])
    # The replay made the calls the step made: every orthogonalized matrix, once.
    for rank, rank_figures in enumerate(data["per_pass"]["shardmuon"][0]):
        batch_total = sum(b for b, _, _ in rank_figures["ns_calls"])
        assert batch_total == sm["matrices_orthogonalized"][rank]
        assert len(rank_figures["ns_times_s"]) == 5  # --ns-repeats default
    assert sm["step_over_ns_spread"]["min"] <= sm["step_over_ns_spread"]["max"]
    assert "a2a_over_minimum" not in rows["adamw"]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_step_single_process_includes_torch_muon(tmp_path):
    out = tmp_path / "step1.json"
    rc = main(
        ["bench", "step", "--nproc", "1", "--layout", "none", "--model", "tiny-dense",
         "--layers", "1", "--steps", "2", "--impl", "shardmuon,torch-muon", "--threads", "1", "--json", str(out),
         "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"shardmuon", "torch-muon"}
    # One process: nothing to exchange, which is the minimum (ratio defined as 1).
    assert rows["shardmuon"]["bytes_sent"] == [0]
    assert rows["shardmuon"]["a2a_over_minimum"] == 1.0
    assert _finite_positive(rows["torch-muon"]["step_s"])


def test_ab_is_close_to_fp64_muon(tmp_path, capsys):
    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    rc = main(
        ["bench", "ab", "--model", "tiny-dense", "--layers", "1", "--steps", "2",
         "--coefficients", "dion", "--threads", "1", "--json", str(out), "--plot", str(png),
         "--no-progress"]
    )  # fmt: skip
    assert rc == 0
    _check_printed_table(capsys.readouterr().out, ["step N", "noise floor"])
    data = json.loads(out.read_text())
    rows = {(r["preset"], r["newton_schulz_impl"]): r for r in data["results"]}
    assert set(rows) == {("dion", "folded"), ("dion", "unfolded"), ("dion", "gram")}
    for r in rows.values():
        assert len(r["vs_fp64"]) == len(r["noise_floor"]) == 2
        # A wrong scale, sign, momentum or partition in either Muon would be off by O(1).
        assert all(0 < e < 0.05 for e in r["vs_fp64"]), r
        assert all(0 < e < 0.05 for e in r["noise_floor"]), r
    assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "ns", "--shapes", "8xfoo"], "bad shape '8xfoo'"),
        (["bench", "ns", "--coefficients", "dion,nope"], "bad --coefficients"),
        (["bench", "ns", "--dtypes", "bf16,int8"], "bad --dtypes 'bf16,int8'; accepted"),
        (["bench", "ab", "--coefficients", "nope"], "bad --coefficients 'nope'"),
        (["bench", "step", "--nproc", "3", "--layout", "hsdp", "--mesh", "2x2"], "has 4 ranks"),
        (["bench", "step", "--nproc", "2", "--impl", "torch-muon"], "--impl torch-muon"),
        (["bench", "step", "--impl", "sgd"], "bad --impl 'sgd'"),
        (["bench", "step", "--layout", "ep", "--impl", "dion"], "--impl dion: dion's Muon"),
    ],
)
def test_bad_values_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_choice_exits_2_from_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "step", "--layout", "tp"])
    assert exc.value.code == 2
    assert "invalid choice: 'tp'" in capsys.readouterr().err


def test_console_script_reports_bad_arguments_without_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "shardmuon", "bench", "ns", "--shapes", "0x4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "bad shape '0x4'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_without_subcommand_means_step():
    assert _default_bench_command(["bench"]) == ["bench", "step"]
    assert _default_bench_command(["bench", "--nproc", "2"]) == ["bench", "step", "--nproc", "2"]
    assert _default_bench_command(["bench", "ns"]) == ["bench", "ns"]
    assert _default_bench_command(["bench", "--help"]) == ["bench", "--help"]
    # A bare word is a sub-command, right or wrong: never run `step` with it as an argument.
    assert _default_bench_command(["bench", "stpe"]) == ["bench", "stpe"]


def test_misspelt_subcommand_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "stpe"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    choices = ", ".join(map(repr, SUBCOMMANDS))
    assert f"invalid choice: 'stpe' (choose from {choices})" in err


def test_train_json_flag_is_an_option_not_a_subcommand():
    args = build_parser().parse_args(["train", "--json", "x.json", "--plot", "x.png"])
    assert (args.json, args.plot, args.train_command) == ("x.json", "x.png", None)


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        # One name for one thing on every command; the old names still parse.
        (["bench", "step", "--coefficients", "keller"], "coefficients", "keller"),
        (["bench", "step", "--preset", "keller"], "coefficients", "keller"),
        (["bench", "ns", "--presets", "keller,dion"], "coefficients", "keller,dion"),
        (["bench", "ab", "--presets", "keller"], "coefficients", "keller"),
        (["train", "--coefficients", "keller"], "coefficients", "keller"),
        (["bench", "step", "--layers", "3"], "layers", 3),
        (["train", "--layers", "3"], "num_layers", 3),
        (["train", "--num-layers", "3"], "num_layers", 3),
        (["train", "--no-progress"], "quiet", True),
        (["train", "--quiet"], "quiet", True),
        (["train", "plot", "a.json", "--out", "c.png"], "plot", "c.png"),
    ],
)
def test_flag_vocabulary_and_old_aliases(argv, dest, value):
    assert getattr(build_parser().parse_args(argv), dest) == value


# argparse's rendering of the --model choices: every preset, sorted.
MODEL_CHOICES = "{" + ",".join(sorted(MODEL_PRESETS)) + "}"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["bench", "step", "--help"],
            [MODEL_CHOICES, "(default: tiny-moe)",
             "{none,fsdp,hsdp,ep,fsdp-tp}", "(default: fsdp)", "(default: 12)", "(default: dion)",
             "{sequential,abba}", "(default: sequential)"],
        ),
        (["bench", "ns", "--help"], ["(default: 5)", "{auto,cpu,cuda}", "(default: auto)"]),
        (["bench", "ab", "--help"], ["(default: 3)", "(default: 0.02)"]),
        (
            ["train", "--help"],
            [MODEL_CHOICES, "(default: tiny-moe; --task lm: lm-llama)",
             "{muon,adamw}", "(default: 150; --task lm: 300)", "{fsdp,ep,fsdp-tp}", "--mesh DPxTP", "on --resume: the checkpoint's"],
        ),
    ],
)  # fmt: skip
def test_help_shows_choices_and_defaults(argv, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    # argparse wraps long help lines; compare with the wrapping undone.
    text = " ".join(capsys.readouterr().out.split())
    for item in expected:
        assert item in text, item


# ------------------------------------------------------------------------ building blocks


def test_published_shapes_of_the_large_presets():
    qwen = param_shapes("qwen3-30b-a3b", 2)
    # From Qwen3-30B-A3B's config: hidden 2048, 32 heads x 128, 4 KV heads, 128 experts of 768.
    assert qwen["model.layers.1.self_attn.q_proj.weight"] == (4096, 2048)
    assert qwen["model.layers.1.self_attn.k_proj.weight"] == (512, 2048)
    assert qwen["model.layers.1.mlp.experts.gate_up_proj"] == (128, 1536, 2048)
    assert qwen["model.layers.1.mlp.experts.down_proj"] == (128, 2048, 768)
    assert qwen["model.embed_tokens.weight"] == (151936, 2048)
    glm = param_shapes("glm-4.5-air", 2)
    # GLM-4.5-Air: hidden 4096, 96 heads x 128, layer 0 dense (10944), then 128 experts of
    # 1408 plus one shared expert.
    assert glm["model.layers.0.mlp.gate_proj.weight"] == (10944, 4096)
    assert glm["model.layers.1.self_attn.q_proj.weight"] == (12288, 4096)
    assert glm["model.layers.1.mlp.experts.gate_up_proj"] == (128, 2816, 4096)
    assert glm["model.layers.1.mlp.shared_experts.down_proj.weight"] == (4096, 1408)
    assert not any(".layers.2." in n for n in glm)


def test_tiny_moe_has_a_dense_layer_then_experts():
    shapes = param_shapes("tiny-moe")
    assert "model.layers.0.mlp.gate_proj.weight" in shapes
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"][0] == 8
    model = build_model("tiny-dense", seed=3)
    again = build_model("tiny-dense", seed=3)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_bad_presets_and_layouts_raise_value_error():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        param_shapes("gpt5")
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        build_model("tiny-dense", num_layers=0)
    with pytest.raises(ValueError, match="accepted: none, fsdp, hsdp, ep"):
        plan_layout("tp", 2)
    with pytest.raises(ValueError, match="needs a 2-D mesh shape"):
        plan_layout("ep", 4, (4,))
    assert plan_layout("hsdp", 4).mesh_shape == (2, 2)
    assert plan_layout("ep", 2).mesh_shape == (2, 1)
    assert set(MODEL_PRESETS) >= {"tiny-moe", "tiny-dense", "qwen3-30b-a3b", "glm-4.5-air"}


def test_cpu_step_memory_sees_a_known_allocation():
    n = 1 << 18  # 1 MiB of float32

    def step():
        a = torch.ones(n)
        b = a * 2  # a and b alive together: 2 MiB
        del a
        return float(b.sum())

    mem = measure_cpu_step(step, baseline_bytes=1000)
    assert 2 * 4 * n <= mem.transient_bytes < 2 * 4 * n + 4096
    assert mem.peak_bytes == mem.transient_bytes + 1000
    assert peak_of_events([(2, -5), (0, 10), (1, 7), (3, 1)]) == 17
    w = torch.zeros(10, 10)
    assert live_bytes([w, w[0], None, torch.zeros(3)]) == 400 + 12
