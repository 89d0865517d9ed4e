"""QK-clip's record-only mode (issue #30 item 4): ``QKClip(model, threshold=None)`` measures
every head's max logit and never scales, and one function checks the settings for
``QKClip``, its setters and ``MuonConfig``'s ``qk_clip_*`` fields."""

from __future__ import annotations

import pytest
import torch
import transformers

from shardmuon.qk_clip import QKClip, check_qk_clip_settings, find_attention_layers


def _model() -> torch.nn.Module:
    """A tiny Llama whose first layer's logits run far above the thresholds used here."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = find_attention_layers(model)[0]
    with torch.no_grad():
        for module in (layer.q_module, layer.k_module):
            module.weight.mul_(16.0)
    return model.train()


def _forward(model: torch.nn.Module) -> None:
    model(input_ids=torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)))


def test_a_record_only_clip_measures_and_scales_nothing():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    clip = QKClip(model, threshold=None)
    try:
        assert clip.record_only and clip.threshold is None
        _forward(model)
        stats = clip.apply()
        assert stats.threshold is None and stats.clipped_heads == 0 and stats.min_gamma == 1.0
        assert stats.max_logit > 5.0  # the blown-up layer
        assert stats.max_logit_after == stats.max_logit
        assert all(layer.max_logits_after == layer.max_logits for layer in stats.layers)
        for name, param in model.named_parameters():
            assert torch.equal(param, before[name]), name
    finally:
        clip.remove()
    # The same maxima as a clip that measures at a threshold without scaling.
    clip = QKClip(model, threshold=5.0)
    try:
        _forward(model)
        measured = clip.apply(scale=False)
        assert [la.max_logits for la in measured.layers] == [la.max_logits for la in stats.layers]
        assert measured.clipped_heads > 0  # the heads it would clip
    finally:
        clip.remove()


def test_the_threshold_can_be_switched_to_record_only_and_back():
    clip = QKClip(_model(), threshold=5.0)
    try:
        clip.threshold = None
        assert clip.record_only
        clip.threshold = 7
        assert (clip.threshold, clip.record_only) == (7.0, False)
    finally:
        clip.remove()


def test_one_check_spells_the_settings_as_its_caller_names_them():
    assert check_qk_clip_settings() == (None, 0.5)
    assert check_qk_clip_settings(12, 0.25) == (12.0, 0.25)
    with pytest.raises(ValueError, match=r"^qk_clip_threshold must be a finite number > 0, got 0$"):
        check_qk_clip_settings(0, field_prefix="qk_clip_")
    with pytest.raises(ValueError, match=r"^qk_clip_alpha must be in \[0, 1\]"):
        check_qk_clip_settings(alpha=2, field_prefix="qk_clip_")
    with pytest.raises(TypeError, match=r"^threshold must be a number, got '5'$"):
        check_qk_clip_settings("5")
