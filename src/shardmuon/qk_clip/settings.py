"""QK-clip's settings, checked in one place: :class:`~shardmuon.qk_clip.QKClip`, its
setters and ``shardmuon.MuonConfig``'s ``qk_clip_*`` fields all call
:func:`check_qk_clip_settings`."""

from __future__ import annotations

import math
import numbers

from torch import Tensor

from shardmuon.qk_clip.logits import DEFAULT_CHUNK_ELEMENTS

__all__ = ["check_qk_clip_settings"]


def _real(name: str, value: object) -> float:
    """``value`` as a float: Python, numpy and 0-d tensor numbers; bools and strings refused."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got {value!r}") from None


def check_qk_clip_settings(
    threshold: float | None = None,
    alpha: float = 0.5,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    *,
    field_prefix: str = "",
) -> tuple[float | None, float]:
    """The one check of QK-clip's settings: ``TypeError``/``ValueError`` naming a bad one and
    what is accepted; returns the threshold (``None``: record only) and alpha as floats.

    ``field_prefix``: how the caller spells the settings in its messages (``"qk_clip_"``
    for ``MuonConfig``'s ``qk_clip_threshold`` / ``qk_clip_alpha``); check one setting
    alone by leaving the other at its default.
    """
    tau = None
    if threshold is not None:
        tau = _real(f"{field_prefix}threshold", threshold)
        if not math.isfinite(tau) or tau <= 0:
            raise ValueError(
                f"{field_prefix}threshold must be a finite number > 0, got {threshold!r}"
            )
    share = _real(f"{field_prefix}alpha", alpha)
    if not 0.0 <= share <= 1.0:
        raise ValueError(
            f"{field_prefix}alpha must be in [0, 1] (the query's share of the scale), got {alpha!r}"
        )
    if isinstance(chunk_elements, bool) or not isinstance(chunk_elements, int):
        raise TypeError(f"chunk_elements must be an int, got {chunk_elements!r}")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    return tau, share
