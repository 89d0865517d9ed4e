"""QK-clip on one process, against an independent float64 reference (the logits recomputed
from each layer's own projections, QK-norm gains and rotary embedding on the inputs it saw:
``tests/support/attention_reference.py``): the recorded maxima (biases, fused QKV, QK-norm,
masks, flash attention's padding masks and packed sequences, micro-batches), the guarantee
after ``apply()``, the scaled rows, when recording stops, and ``remove()``.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import capture_attention_inputs, reference_max_logits
from qk_models import make_model, record, tokens
from torch import nn

from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("no_leftover_clips")


@pytest.mark.parametrize("kind", ["llama", "llama-bias", "qwen3", "phi3"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_recorded_max_logits_match_the_fp64_recomputation(kind, kv_heads) -> None:
    model = make_model(kind, kv_heads=kv_heads)
    clip = QKClip(model, threshold=5.0)
    try:
        reference, _ = record(model, clip, tokens(), tokens(seed=2))
        stats = clip.apply(scale=False)
        for layer in stats.layers:
            got = torch.tensor(layer.max_logits, dtype=torch.float64)
            torch.testing.assert_close(got, reference[layer.name], rtol=2e-5, atol=1e-5)
        assert stats.max_logit > 8  # the blown-up layer: above the thresholds used here
    finally:
        clip.remove()


@pytest.mark.parametrize("kind", ["llama", "llama-bias", "qwen3", "phi3"])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("alpha", [0.5, 0.0, 1.0, 0.3])
def test_after_apply_no_head_exceeds_tau_on_the_same_inputs(kind, kv_heads, alpha) -> None:
    """Each layer on the inputs it saw, with its new weights: every head at most tau (1e-3
    relative, fp32 weights); MHA heads that were not clipped keep their logits exactly."""
    tau = 7.0
    model = make_model(kind, kv_heads=kv_heads)
    clip = QKClip(model, threshold=tau, alpha=alpha)
    try:
        before, inputs = record(model, clip, tokens())
        stats = clip.apply()
        assert stats.clipped_heads > 0
        assert stats.max_logit_after <= tau * (1 + 1e-9)
        for layer, layer_stats in zip(clip.layers, stats.layers):
            after = reference_max_logits(layer, inputs[layer.name])
            # The stats' prediction (S_h times its factors) is what the new weights give.
            predicted = torch.tensor(layer_stats.max_logits_after, dtype=torch.float64)
            torch.testing.assert_close(predicted, after, rtol=1e-4, atol=1e-5)
            clipped = before[layer.name] > tau
            assert (after[clipped] <= tau * (1 + 1e-3)).all(), (layer.name, after, before)
            assert (after <= torch.maximum(before[layer.name], torch.tensor(tau)) * 1.001).all()
            if kv_heads == 4 and not layer.qk_norm:
                torch.testing.assert_close(after[~clipped], before[layer.name][~clipped])
    finally:
        clip.remove()


def test_a_one_layer_model_rerun_records_at_most_tau() -> None:
    model = make_model("llama", kv_heads=2, layers=1)
    clip = QKClip(model, threshold=6.0)
    try:
        x = tokens()
        model(x)
        assert clip.apply().max_logit > 6.0
        model(x)
        assert clip.apply().max_logit <= 6.0 * (1 + 1e-3)
    finally:
        clip.remove()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("alpha", [0.5, 0.25])
def test_scaled_rows_follow_the_rule_as_written(kv_heads, alpha) -> None:
    """Query head h: gamma_h ** alpha; key head j: (min over its query heads of gamma) **
    (1 - alpha); gamma = tau' / S for S > tau', else 1 (S from the fp64 reference; tau' the
    threshold less fp32's rounding slack, 2^-16); values and other layers' rows untouched."""
    threshold = 9.0
    tau = threshold * (1 - 2**-16)
    model = make_model("llama-bias", kv_heads=kv_heads)
    clip = QKClip(model, threshold=threshold, alpha=alpha)
    try:
        old = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        reference, _ = record(model, clip, tokens())
        stats = clip.apply()
        assert {layer.target for layer in stats.layers} == {tau}
        for layer in clip.layers:
            S = reference[layer.name]
            gamma = torch.where(tau < S, tau / S, torch.ones_like(S))
            group = layer.num_heads // layer.num_kv_heads
            q_scale = gamma**alpha
            k_scale = gamma.view(layer.num_kv_heads, group).amin(1) ** (1 - alpha)
            prefix = layer.name
            for proj, scale in (("q_proj", q_scale), ("k_proj", k_scale)):
                rows = scale.repeat_interleave(layer.head_dim)
                for kind, shape in (("weight", (-1, 1)), ("bias", (-1,))):
                    name = f"{prefix}.{proj}.{kind}"
                    new = dict(model.named_parameters())[name].detach().double()
                    torch.testing.assert_close(new, old[name] * rows.view(shape), rtol=2e-6, atol=0)
            for kind in ("weight", "bias"):
                name = f"{prefix}.v_proj.{kind}"
                assert torch.equal(dict(model.named_parameters())[name].double(), old[name])
    finally:
        clip.remove()


def test_qk_norm_layers_scale_the_gains_by_the_layers_smallest_gamma() -> None:
    threshold, alpha = 8.0, 0.5
    tau = threshold * (1 - 2**-16)  # less fp32's rounding slack
    model = make_model("qwen3", kv_heads=2)
    clip = QKClip(model, threshold=threshold, alpha=alpha)
    try:
        old = {n: p.detach().clone() for n, p in model.named_parameters()}
        reference, _ = record(model, clip, tokens())
        clip.apply()
        params = dict(model.named_parameters())
        for layer in clip.layers:
            smallest = min(1.0, tau / float(reference[layer.name].max()))
            for norm, power in (("q_norm", alpha), ("k_norm", 1 - alpha)):
                name = f"{layer.name}.{norm}.weight"
                expected = old[name].double() * smallest**power
                torch.testing.assert_close(params[name].double(), expected, rtol=2e-7, atol=0)
            for proj in ("q_proj", "k_proj"):  # the norm would undo a row scale
                name = f"{layer.name}.{proj}.weight"
                assert torch.equal(params[name], old[name])
    finally:
        clip.remove()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padding_is_masked_out_as_the_model_masks_it(impl) -> None:
    """A padded batch: bool masks (sdpa) and additive float masks (eager) both exclude the
    padded keys, as the fp64 reference with the same padding does."""
    model = make_model("llama", kv_heads=2, impl=impl)
    clip = QKClip(model, threshold=5.0)
    try:
        x = tokens(batch=3, seq=9)
        padding = torch.ones_like(x)
        padding[0, :4] = 0  # left padding
        padding[2, 6:] = 0  # right padding
        reference, _ = record(model, clip, x, attention_mask=padding)
        stats = clip.apply(scale=False)
        for layer in stats.layers:
            got = torch.tensor(layer.max_logits, dtype=torch.float64)
            torch.testing.assert_close(got, reference[layer.name], rtol=2e-5, atol=1e-5)
    finally:
        clip.remove()


def test_micro_batches_keep_the_running_max_and_apply_resets_it() -> None:
    model = make_model("llama", kv_heads=2)
    clip = QKClip(model, threshold=5.0)
    try:
        a, b = tokens(seed=3), tokens(batch=2, seq=6, seed=4)
        record(model, clip, a)
        alone_a = clip.apply(scale=False)
        record(model, clip, b)
        alone_b = clip.apply(scale=False)
        record(model, clip, a, b)
        both = clip.apply(scale=False)
        for la, lb, lab in zip(alone_a.layers, alone_b.layers, both.layers):
            assert lab.max_logits == tuple(map(max, la.max_logits, lb.max_logits))
            assert la.max_logits != lb.max_logits
    finally:
        clip.remove()


def test_recording_stops_in_eval_mode_and_when_switched_off() -> None:
    model = make_model("llama")
    clip = QKClip(model, threshold=5.0)
    try:
        model.eval()
        model(tokens())
        with pytest.raises(RuntimeError, match="no forward pass was recorded"):
            clip.apply()
        model.train()
        clip.recording = False
        model(tokens())
        with pytest.raises(RuntimeError, match="no forward pass was recorded"):
            clip.apply()
        clip.recording = True
        model(tokens())
        assert clip.apply(scale=False).max_logit > 5.0
    finally:
        clip.remove()


def test_scale_false_and_heads_at_the_threshold_leave_weights_alone() -> None:
    model = make_model("llama")
    clip = QKClip(model, threshold=5.0)
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(tokens())
        stats = clip.apply(scale=False)
        assert stats.clipped_heads > 0 and stats.min_gamma < 1
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        # A threshold above every logit: nothing clipped, nothing written.
        clip.threshold = 1e6
        model(tokens())
        stats = clip.apply()
        assert (stats.clipped_heads, stats.min_gamma) == (0, 1.0)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert stats.as_dict()["layers"].keys() == {lay.name for lay in clip.layers}
    finally:
        clip.remove()


def test_remove_restores_the_attention_functions_and_outputs_are_unchanged() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    original = AttentionInterface._global_mapping["sdpa"]
    model = make_model("llama", kv_heads=2)
    x = tokens()
    with torch.no_grad():
        plain = model(x).logits
    clip = QKClip(model, threshold=5.0)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original
    with torch.no_grad():
        recorded = model(x).logits
    assert torch.equal(plain, recorded)  # recording changes no output
    with pytest.raises(ValueError, match="already record for another QKClip"):
        QKClip(model, threshold=5.0)
    clip.remove()
    clip.remove()  # idempotent
    assert AttentionInterface._global_mapping["sdpa"] is original
    QKClip(model, threshold=5.0).remove()  # can be built again after a remove


def test_eager_attention_is_recorded_through_the_models_own_eager_function() -> None:
    from transformers.modeling_utils import AttentionInterface

    model = make_model("llama", kv_heads=2, impl="eager")
    clip = QKClip(model, threshold=5.0)
    try:
        reference, _ = record(model, clip, tokens())
        stats = clip.apply(scale=False)
        got = torch.tensor(stats.layers[0].max_logits, dtype=torch.float64)
        torch.testing.assert_close(got, reference[stats.layers[0].name], rtol=2e-5, atol=1e-5)
    finally:
        clip.remove()
    assert "eager" not in AttentionInterface._global_mapping


def test_an_identity_norm_is_no_norm() -> None:
    model = make_model("llama", kv_heads=2)
    for layer in model.model.layers:
        layer.self_attn.q_norm, layer.self_attn.k_norm = nn.Identity(), nn.Identity()
    clip = QKClip(model, threshold=6.0)
    try:
        assert not any(layer.qk_norm for layer in clip.layers)
        _, inputs = record(model, clip, tokens())
        clip.apply()
        layer = clip.layers[0]
        assert (reference_max_logits(layer, inputs[layer.name]) <= 6.0 * (1 + 1e-3)).all()
    finally:
        clip.remove()


@pytest.fixture
def fake_flash():
    """flash_attention_2's calling convention on a CPU: Hugging Face builds its 2-D padding
    mask and passes position_ids as on a GPU; the stand-in computes with sdpa."""
    from transformers.modeling_utils import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        group = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, is_causal=True, scale=scaling
        )
        return out.transpose(1, 2).contiguous(), None

    saved = AttentionInterface._global_mapping.get("flash_attention_2")
    AttentionInterface.register("flash_attention_2", attention)
    yield
    AttentionInterface.register("flash_attention_2", saved)


@pytest.mark.usefixtures("fake_flash")
def test_flash_padding_masks_and_packed_sequences_are_read_as_flash_reads_them() -> None:
    """Before: a 2-D padding mask crashed (or, when batch == length, was read as query
    rows: 43% off), and packed documents were seen across (58% too high)."""
    model = make_model("llama", kv_heads=2)
    model.config._attn_implementation = "flash_attention_2"
    clip = QKClip(model, threshold=4.0)
    try:
        for batch, seq in ((3, 14), (4, 4)):
            x = tokens(batch, seq, seed=batch)
            padding = torch.ones_like(x)
            padding[0, : seq // 3] = 0
            padding[-1, seq - 1 :] = 0
            reference, _ = record(model, clip, x, attention_mask=padding)
            stats = clip.apply(scale=False)
            for layer in stats.layers:
                got = torch.tensor(layer.max_logits, dtype=torch.float64)
                torch.testing.assert_close(got, reference[layer.name], rtol=2e-5, atol=1e-5)
        x = tokens(1, 14, seed=9)
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 4]])
        documents = (positions == 0).cumsum(-1)
        with capture_attention_inputs(model, [lay.module for lay in clip.layers]) as captured:
            model(x, position_ids=positions)
        stats = clip.apply(scale=False)
        for layer, layer_stats in zip(clip.layers, stats.layers):
            ref = reference_max_logits(layer, captured[layer.module], segments=documents)
            got = torch.tensor(layer_stats.max_logits, dtype=torch.float64)
            torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-5)
    finally:
        clip.remove()
