"""QK-clip (MuonClip): keep every attention head's max logit at or below a threshold.

``QKClip(model, threshold, alpha)`` records each head's largest pre-softmax logit in the
forward passes and, called after ``optimizer.step()``, scales the query and key rows of the
heads above the threshold, on every layout the optimizer runs on. See ``docs/design.md``
("QK-clip") for the rule and what is refused.
"""

from shardmuon.qk_clip.clip import LayerClipStats, QKClip, QKClipStats
from shardmuon.qk_clip.discovery import AttentionLayer, find_attention_layers
from shardmuon.qk_clip.settings import check_qk_clip_settings

__all__ = [
    "AttentionLayer",
    "LayerClipStats",
    "QKClip",
    "QKClipStats",
    "check_qk_clip_settings",
    "find_attention_layers",
]
