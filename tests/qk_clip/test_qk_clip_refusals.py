"""What QK-clip refuses, naming what it accepts or the module at fault: bad settings (numbers of
any kind are taken, edits checked), models it cannot clip (no attention, wrong shapes, latent
or interleaved attention, norms that do not scale with their gain), flex attention, an
implementation changed after the build, a layer that did not record, a non-finite logit;
and a clip dropped without ``remove()`` detaching itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from qk_models import VOCAB, make_model, tokens
from torch import nn

from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("no_leftover_clips")


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
