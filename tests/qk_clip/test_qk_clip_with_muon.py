"""QK-clip next to the optimizer: ``MuonConfig`` builds the clip from its fields, the clip
writes the weights only (not Muon's momentum), and with offloaded state the clipped run
is bitwise the plain one.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import weight_of
from qk_models import make_model, tokens

from shardmuon.config import MuonConfig, build_qk_clip
from shardmuon.qk_clip import QKClip

pytestmark = pytest.mark.usefixtures("no_leftover_clips")


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
