"""QK-clip on one process, against an independent float64 reference (the logits recomputed
from each layer's own projections, QK-norm gains and rotary embedding on the inputs it saw:
``tests/support/attention_reference.py``): the recorded maxima, the guarantee after
``apply()``, the scaled rows, the grouped-query rule, QK-norm, biases, fused QKV, masks,
micro-batches, and every refusal.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from attention_reference import (
    capture_attention_inputs,
    reference_max_logits,
    weight_of,
)
from torch import nn

from shardmuon.config import MuonConfig, build_qk_clip
from shardmuon.qk_clip import QKClip, find_attention_layers
from shardmuon.qk_clip.logits import key_factors, max_logits_per_head, query_factors

VOCAB = 96


def make_model(kind: str = "llama", *, heads=4, kv_heads=4, layers=2, seed=0, impl="sdpa"):
    """A tiny Hugging Face model; its first layer's q/k weights blown up so that its logits
    run to ~30 (far above the thresholds used here) while layer 1 stays small."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    if kind == "llama":
        config = transformers.LlamaConfig(head_dim=16, **common)
    elif kind == "llama-bias":
        config = transformers.LlamaConfig(head_dim=16, attention_bias=True, **common)
    elif kind == "qwen3":  # QK-norm
        config = transformers.Qwen3Config(head_dim=16, **common)
    elif kind == "phi3":  # fused [Q; K; V]
        config = transformers.Phi3Config(pad_token_id=0, **common)
    else:
        raise ValueError(kind)
    config._attn_implementation = impl
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = find_attention_layers(model)[0]
    with torch.no_grad():
        if layer.qk_norm:
            layer.q_norm.weight.mul_(6.0)
            layer.k_norm.weight.mul_(6.0)
        else:
            for module in {layer.q_module, layer.k_module}:
                module.weight.mul_(16.0)
                # Different heads, different sizes: some clipped, some not.
                rows = torch.linspace(0.3, 1.5, module.weight.shape[0] // 16).repeat_interleave(16)
                module.weight.mul_(rows[:, None])
    model.train()
    return model


def tokens(batch=3, seq=10, seed=1):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def record(model, clip, *batches, **kwargs):
    """Run the forwards with inputs captured; return ``{layer name: reference maxima}``."""
    layers = clip.layers
    with capture_attention_inputs(model, [lay.module for lay in layers]) as captured:
        for batch in batches:
            model(batch, **kwargs)
    mask = kwargs.get("attention_mask")
    return {lay.name: reference_max_logits(lay, captured[lay.module], mask) for lay in layers}, {
        lay.name: captured[lay.module] for lay in layers
    }


@pytest.fixture(autouse=True)
def _no_leftover_clips():
    yield
    from shardmuon.qk_clip import recording

    assert not recording._INSTALLED, "a test left a QKClip installed (call remove())"


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


# ------------------------------------------------------------------ max_logits_per_head


def _naive(query, key, scaling, valid):
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.mT * scaling
    return scores.masked_fill(~valid, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("chunk_elements", [1, 7, 64, 1 << 22])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
def test_blocked_maxima_equal_the_full_score_matrix(chunk_elements, heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 9, 8, generator=gen, dtype=torch.float64)
    # Causal with a 4-token past (a cache): query i sees keys <= i + 4.
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)
    got = max_logits_per_head(q, k, 0.3, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, causal))
    window = causal & ~torch.ones(5, 9, dtype=torch.bool).tril(4 - 3)
    got = max_logits_per_head(q, k, 0.3, sliding_window=3, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, window))
    mask = torch.rand(2, 1, 5, 9, generator=gen) > 0.4
    mask[..., 0] = True
    got = max_logits_per_head(q, k, 0.3, mask, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, mask))
    # Hugging Face's additive masks put the dtype's lowest value on masked pairs.
    additive = torch.zeros(2, 1, 5, 9, dtype=torch.float64)
    additive = additive.masked_fill(~mask, torch.finfo(torch.float64).min)
    got = max_logits_per_head(q, k, 0.3, additive, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, mask))
    got = max_logits_per_head(q, k, 0.3, causal=False, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, torch.ones(5, 9, dtype=torch.bool)))


def test_the_block_depends_on_the_global_head_count_only() -> None:
    """Half the heads (a tensor-parallel rank) with chunk_heads = all heads: bitwise the
    same maxima as the whole computation, for fp32 inputs."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 37, 16, generator=gen)
    k = torch.randn(3, 4, 37, 16, generator=gen)
    whole = max_logits_per_head(q, k, 0.25, chunk_elements=2000)
    halves = [
        max_logits_per_head(
            q[:, 4 * i : 4 * i + 4], k[:, 2 * i : 2 * i + 2], 0.25, chunk_heads=8,
            chunk_elements=2000,
        )
        for i in range(2)
    ]  # fmt: skip
    assert torch.equal(torch.cat(halves), whole)


@pytest.mark.parametrize("seq", [5, 40])
def test_a_batch_split_over_ranks_gives_the_maxima_bitwise(seq) -> None:
    """Five sequences at once or as 2 + 3 (two data-parallel ranks), short sequences grouped
    and long ones cut into query blocks: the same fp32 maxima, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 4, seq, 16, generator=gen)
    k = torch.randn(5, 2, seq, 16, generator=gen)
    whole = max_logits_per_head(q, k, 0.25, chunk_elements=900)
    parts = [
        max_logits_per_head(q[s], k[s], 0.25, chunk_elements=900)
        for s in (slice(0, 2), slice(2, 5))
    ]
    assert torch.equal(torch.maximum(*parts), whole)


def test_factors_of_the_grouped_query_rule() -> None:
    gammas = torch.tensor([1.0, 0.5, 0.8, 1.0, 0.25, 0.9], dtype=torch.float64)
    torch.testing.assert_close(query_factors(gammas, 0.5), gammas.sqrt())
    torch.testing.assert_close(
        key_factors(gammas, 2, 0.5), torch.tensor([0.5, 0.25], dtype=torch.float64).sqrt()
    )
    torch.testing.assert_close(key_factors(gammas, 6, 0.0), gammas)
    torch.testing.assert_close(key_factors(gammas, 3, 1.0), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="6 query heads do not divide into 4 key heads"):
        key_factors(gammas, 4, 0.5)


# -------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(threshold=0), ValueError, r"threshold must be a finite number > 0, got 0"),
        (dict(threshold=-3.0), ValueError, r"got -3.0"),
        (dict(threshold=math.nan), ValueError, r"got nan"),
        (dict(threshold=math.inf), ValueError, r"got inf"),
        (dict(threshold="100"), TypeError, r"threshold must be a number, got '100'"),
        (dict(threshold=True), TypeError, r"threshold must be a number, got True"),
        (dict(alpha=-0.1), ValueError, r"alpha must be in \[0, 1\].*got -0.1"),
        (dict(alpha=1.5), ValueError, r"got 1.5"),
        (dict(chunk_elements=0), ValueError, r"chunk_elements must be >= 1, got 0"),
    ],
)
def test_bad_settings_are_refused_with_what_is_accepted(kwargs, error, pattern) -> None:
    with pytest.raises(error, match=pattern):
        QKClip(make_model("llama"), **kwargs)


class _Attention(nn.Module):
    def __init__(self, **children):
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


class _Holder(nn.Module):
    def __init__(self, attention, **config):
        super().__init__()
        self.config = transformers.PretrainedConfig(**config)
        self.config._attn_implementation = "sdpa"
        self.self_attn = attention


def test_models_that_cannot_be_clipped_are_refused_naming_the_module() -> None:
    with pytest.raises(ValueError, match="no attention layer found in Linear"):
        QKClip(nn.Linear(4, 4))
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    bad_rows = _Attention(q_proj=nn.Linear(16, 30), k_proj=nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"self_attn: q_proj has 30 rows, not heads x head_dim"):
        QKClip(_Holder(bad_rows, **heads))
    bad_groups = _Attention(q_proj=nn.Linear(16, 24), k_proj=nn.Linear(16, 16))
    with pytest.raises(ValueError, match="3 attention heads do not divide into 2 key/value"):
        QKClip(_Holder(bad_groups, num_attention_heads=3, num_key_value_heads=2, head_dim=8))
    mla = _Attention(q_a_proj=nn.Linear(16, 8), kv_a_proj_with_mqa=nn.Linear(16, 8))
    with pytest.raises(ValueError, match="self_attn is multi-head latent attention"):
        QKClip(_Holder(mla, **heads))
    interleaved = _Attention(query_key_value=nn.Linear(16, 64))
    with pytest.raises(ValueError, match="query_key_value: GPT-NeoX, Falcon and Bloom interleave"):
        QKClip(_Holder(interleaved, **heads))
    conv = _Attention(c_attn=transformers.pytorch_utils.Conv1D(48, 16))
    with pytest.raises(ValueError, match=r"c_attn is a Conv1D, whose weight is stored \[in, out\]"):
        QKClip(_Holder(conv, **heads))
    only_q = _Attention(q_proj=nn.Linear(16, 32), k_proj=nn.Linear(16, 16), q_norm=nn.LayerNorm(8))
    with pytest.raises(ValueError, match="self_attn normalises only its queries"):
        QKClip(_Holder(only_q, **heads))
    no_gain = _Attention(
        q_proj=nn.Linear(16, 32), k_proj=nn.Linear(16, 16),
        q_norm=nn.LayerNorm(8, elementwise_affine=False),
        k_norm=nn.LayerNorm(8, elementwise_affine=False),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"self_attn.q_norm has no gain"):
        QKClip(_Holder(no_gain, **heads))
    no_count = _Attention(q_proj=nn.Linear(16, 32), k_proj=nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no head count found"):
        QKClip(_Holder(no_count))


def test_a_layer_that_did_not_record_is_left_alone_and_named_once() -> None:
    """A layer that did not run this step (a vision tower on a text-only batch), or bypasses
    the attention functions: a warning naming it (once), its weights untouched."""
    model = make_model("llama", kv_heads=2)
    clip = QKClip(model, threshold=0.01)
    try:
        from shardmuon.qk_clip import recording

        del recording._RECORDERS[clip.layers[0].module]  # as if layer 0 ran its own kernel
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(tokens())
        with pytest.warns(UserWarning, match=r"model.layers.0.self_attn recorded nothing"):
            stats = clip.apply()
        assert stats.layers[0].clipped_heads == 0 and stats.layers[1].clipped_heads > 0
        q0 = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(dict(model.named_parameters())[q0], before[q0])
        model(tokens())
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            clip.apply()  # named once only
    finally:
        clip.remove()


def test_a_non_finite_logit_scales_nothing_and_says_so() -> None:
    model = make_model("llama", kv_heads=2)
    clip = QKClip(model, threshold=5.0)
    try:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight[0, 0] = math.inf
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        model(tokens())
        with pytest.raises(
            RuntimeError, match=r"max logit of model.layers.0.self_attn.*not finite"
        ):
            clip.apply()
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n]), n
    finally:
        clip.remove()


def test_muon_config_builds_the_clip_from_its_fields() -> None:
    model = make_model("llama")
    assert build_qk_clip(model, MuonConfig()) is None
    clip = build_qk_clip(model, MuonConfig(qk_clip_threshold="12.5", qk_clip_alpha=0.25))
    try:
        assert (clip.threshold, clip.alpha) == (12.5, 0.25)
    finally:
        clip.remove()
    with pytest.raises(ValueError, match="qk_clip_threshold must be a finite number > 0"):
        MuonConfig(qk_clip_threshold=0)
    with pytest.raises(ValueError, match=r"qk_clip_alpha must be in \[0, 1\]"):
        MuonConfig(qk_clip_alpha=2)
    assert "qk_clip_threshold" not in MuonConfig(qk_clip_threshold=5).muon_kwargs()


def test_the_weights_written_are_weight_of_the_clip_not_of_the_optimizer_state() -> None:
    """Muon's momentum is not rescaled (Kimi does not either): the clip touches weights."""
    from shardmuon import Muon

    model = make_model("llama", kv_heads=2)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    opt = Muon(matrices, lr=0.01)
    clip = QKClip(model, threshold=5.0)
    try:
        model(tokens()).logits.sum().backward()
        opt.step()
        momentum = {id(p): opt.state[p]["momentum"].clone() for p in matrices}
        clip.apply()
        assert all(torch.equal(opt.state[p]["momentum"], momentum[id(p)]) for p in matrices)
        assert weight_of(model.model.layers[0].self_attn.q_proj.weight) is not None
    finally:
        clip.remove()


def test_with_offloaded_state_the_clipped_run_is_bitwise_the_plain_one() -> None:
    """The clip touches weights only: Muon with ``offload="state"`` and without, each with
    QK-clip after every step, stay bitwise equal."""
    from shardmuon import Muon

    weights = []
    for offload in (None, "state"):
        model = make_model("llama", kv_heads=2)
        opt = Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02, offload=offload)
        clip = QKClip(model, threshold=6.0)
        clipped = 0
        try:
            for step in range(3):
                model(tokens(seed=step)).logits.square().mean().backward()
                opt.step()
                opt.zero_grad()
                clipped += clip.apply().clipped_heads
        finally:
            clip.remove()
        assert clipped > 0
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


# ------------------------------------------------- escapes found by attacking (2026-12-02)


def _hf(config_class, **extra):
    config = config_class(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        **extra,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_norms_that_do_not_scale_with_their_gain_are_refused() -> None:
    """Gemma3's ``x * (1 + w)`` (scaling w would not bound the logits: it did not, 8.2 for
    tau 5, before this check), a LayerNorm with a bias, Llama4's gainless ``qk_norm``."""
    with pytest.raises(ValueError, match=r"q_norm \(Gemma3RMSNorm\) does not scale its output"):
        QKClip(_hf(transformers.Gemma3TextConfig, sliding_window=512))
    model = make_model("llama", kv_heads=2)
    attention = model.model.layers[0].self_attn
    attention.q_norm, attention.k_norm = nn.LayerNorm(16), nn.LayerNorm(16)
    with pytest.raises(ValueError, match=r"q_norm \(LayerNorm\) does not scale its output"):
        QKClip(model)
    attention.q_norm, attention.k_norm = nn.LayerNorm(16, bias=False), nn.LayerNorm(16, bias=False)
    QKClip(model).remove()  # x / rms-like * w without a bias: accepted
    llama4 = _hf(
        transformers.Llama4TextConfig, num_local_experts=2, intermediate_size_mlp=96,
        use_qk_norm=True, no_rope_layers=[1, 1], attn_temperature_tuning=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="normalises its queries or keys with qk_norm"):
        QKClip(llama4)
    gated = _hf(transformers.Qwen3_5TextConfig, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match="2x what the heads need: a gated"):
        QKClip(gated)


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


def test_flex_attention_is_refused_when_the_clip_is_built() -> None:
    model = make_model("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="runs attention implementation 'flex_attention'"):
        QKClip(model)


def test_a_clip_dropped_without_remove_detaches_itself() -> None:
    import gc

    model = make_model("llama")
    clip = QKClip(model, threshold=5.0)
    del clip
    gc.collect()
    QKClip(model, threshold=5.0).remove()  # before: "already record for another QKClip"


def test_an_implementation_changed_after_the_build_is_named() -> None:
    model = make_model("llama")
    clip = QKClip(model, threshold=5.0)
    try:
        model.set_attn_implementation("eager")
        model(tokens())
        with pytest.raises(RuntimeError, match=r"changed to \['eager'\] after QKClip was built"):
            clip.apply()
    finally:
        clip.remove()


def test_numbers_of_any_kind_are_taken_and_edits_are_checked() -> None:
    import numpy as np

    model = make_model("llama")
    for tau in (np.float32(5), np.int64(5), torch.tensor(5.0), 5):
        clip = QKClip(model, threshold=tau, alpha=np.float16(0.25))
        assert (clip.threshold, clip.alpha) == (5.0, 0.25)
        clip.remove()
    with pytest.raises(ValueError, match="threshold must be a finite number"):
        QKClip(model, threshold=10**400)
    clip = QKClip(model, threshold=5.0)
    try:
        with pytest.raises(ValueError, match="threshold must be a finite number > 0, got 0"):
            clip.threshold = 0
        with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
            clip.alpha = 2
        assert (clip.threshold, clip.alpha) == (5.0, 0.5)
    finally:
        clip.remove()
