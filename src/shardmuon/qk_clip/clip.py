"""``QKClip``: record each head's max logit in the forward passes, then after the optimizer
step reduce them over the ranks in one collective and scale the query and key rows of the
heads above the threshold, in place on each rank's shard.

The math is in :mod:`~shardmuon.qk_clip.logits`, the layers in
:mod:`~shardmuon.qk_clip.discovery`, the recording in :mod:`~shardmuon.qk_clip.recording`
and the DTensor side in :mod:`~shardmuon.qk_clip.shards`; this module plans and dispatches.
"""

from __future__ import annotations

import math
import warnings
import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardmuon.planning.placements import local_tensor
from shardmuon.qk_clip.discovery import AttentionLayer, find_attention_layers
from shardmuon.qk_clip.logits import (
    DEFAULT_CHUNK_ELEMENTS,
    head_gammas,
    key_factors,
    query_factors,
    rounding_slack,
    row_factors,
    unit_roundoff,
)
from shardmuon.qk_clip.recording import (
    LayerRecorder,
    check_free,
    implementation_of,
    install,
    uninstall,
)
from shardmuon.qk_clip.settings import check_qk_clip_settings
from shardmuon.qk_clip.shards import check_scalable, scale_rows_, scale_whole_
from shardmuon.runtime.overlap import synchronize_all

__all__ = ["LayerClipStats", "QKClip", "QKClipStats", "check_qk_clip_settings"]


@dataclass(frozen=True)
class LayerClipStats:
    """One layer after :meth:`QKClip.apply`: the max logit of each query head this step
    (over every rank; ``-inf``: none seen), how many heads were above the target, the
    smallest gamma (1.0: nothing clipped), each head's max logit on the same inputs with
    the scaled weights (``S_h`` times its query and key factors: at most the target), and
    the target: the threshold less the rounding slack of the layer's dtypes
    (:func:`~shardmuon.qk_clip.logits.rounding_slack`), so that the logits the rounded
    weights give stay at or below the threshold itself."""

    name: str
    max_logits: tuple[float, ...]
    clipped_heads: int
    min_gamma: float
    max_logits_after: tuple[float, ...] = ()
    target: float = math.nan


@dataclass(frozen=True)
class QKClipStats:
    """What one :meth:`QKClip.apply` saw and did, per layer (``threshold`` ``None``: a
    record-only clip, which scales nothing)."""

    threshold: float | None
    layers: tuple[LayerClipStats, ...]

    @property
    def max_logit(self) -> float:
        """The largest max logit of any head of any layer."""
        return max((max(layer.max_logits) for layer in self.layers), default=-math.inf)

    @property
    def max_logit_after(self) -> float:
        """The largest max logit the same inputs give with the clipped weights."""
        return max((max(layer.max_logits_after) for layer in self.layers), default=-math.inf)

    @property
    def clipped_heads(self) -> int:
        return sum(layer.clipped_heads for layer in self.layers)

    @property
    def min_gamma(self) -> float:
        return min((layer.min_gamma for layer in self.layers), default=1.0)

    def as_dict(self) -> dict:
        """JSON-ready: the totals, and per layer the max logit, clipped heads and min gamma."""
        return {
            "threshold": self.threshold,
            "max_logit": self.max_logit,
            "max_logit_after": self.max_logit_after,
            "clipped_heads": self.clipped_heads,
            "min_gamma": self.min_gamma,
            "layers": {
                layer.name: {
                    "max_logit": max(layer.max_logits),
                    "clipped_heads": layer.clipped_heads,
                    "min_gamma": layer.min_gamma,
                }
                for layer in self.layers
            },
        }


def _targets(layer: AttentionLayer) -> list[tuple[str, Tensor]]:
    """The parameters one layer's clip writes, by name."""
    if layer.qk_norm:
        return [(f"{layer.name}.q_norm.weight", layer.q_norm.weight),
                (f"{layer.name}.k_norm.weight", layer.k_norm.weight)]  # fmt: skip
    names = {child: name for name, child in layer.module.named_children()}
    out = []
    for module in dict.fromkeys((layer.q_module, layer.k_module)):
        for kind in ("weight", "bias"):
            param = getattr(module, kind, None)
            if param is not None:
                out.append((f"{layer.name}.{names.get(module, '?')}.{kind}", param))
    return out


class QKClip:
    """QK-clip (Kimi K2's MuonClip) for a Hugging Face-style model, on any layout.

    Construct once after the model is laid out (FSDP2, HSDP, tensor parallel, ...) on every
    rank (it checks in one all-reduce that all ranks found the same layers and settings);
    run forward/backward as usual (every forward in training mode records each head's max
    logit); call :meth:`apply` right after ``optimizer.step()`` on every rank. ``apply``
    makes exactly one all-reduce (MAX, of all layers' maxima and the settings, over
    ``process_group``: default the whole world, i.e. every rank that holds part of the
    batch or of the heads) and scales weights in place; the optimizer's state is not
    touched. Recording stops while ``recording`` is False or the model is in eval mode.

    Args:
        model: the model; its attention layers are found by
            :func:`~shardmuon.qk_clip.discovery.find_attention_layers`.
        threshold: tau, the largest max logit a head may keep (default 100, Kimi K2's); a
            clipped head is aimed a rounding slack below it (fp32 2^-16, bf16 1/32:
            :func:`~shardmuon.qk_clip.logits.rounding_slack`) so that it ends at or below.
            ``None``: record only, a clip that measures every head's max logit and never
            scales (its stats count no clipped head; the logits after are the logits).
        alpha: the query's share of the scale (default 0.5): a clipped head's query rows
            are scaled by ``gamma ** alpha``, its key rows by ``gamma ** (1 - alpha)``
            (grouped-query: the smallest gamma of the key's query heads).
        process_group: the ranks whose maxima are combined (default: the world when
            ``torch.distributed`` is initialised; none on one process).
        chunk_elements: the most scores recorded at once per layer (default 4 Mi).
    """

    def __init__(
        self,
        model: nn.Module,
        threshold: float | None = 100.0,
        alpha: float = 0.5,
        *,
        process_group: dist.ProcessGroup | None = None,
        chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    ) -> None:
        self._group = process_group
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.group.WORLD
        self._implementations: set[str] = set()
        self._recorders: list[LayerRecorder] = []
        self.layers: list[AttentionLayer] = []
        self.last_stats: QKClipStats | None = None
        self._warned: set[str] = set()
        try:
            self._threshold, self._alpha = check_qk_clip_settings(threshold, alpha, chunk_elements)
            self.layers = find_attention_layers(model)
            for layer in self.layers:
                for name, param in _targets(layer):
                    check_scalable(name, param)
                    self._check_covered(name, param)
            self._implementations = {implementation_of(lay, model) for lay in self.layers}
            check_free(self.layers)
            error = None
        except (TypeError, ValueError) as err:
            error = err
        # Every rank of the group joins this check, a rank that failed above included, so a
        # local failure raises on all of them instead of leaving the others in a collective.
        self._check_agreement(
            self._settings_fields(failed=error is not None), "when QKClip was built", error
        )
        self._model = weakref.ref(model)
        self._recorders = [LayerRecorder(layer, chunk_elements) for layer in self.layers]
        install(self._implementations, self._recorders)
        # A clip dropped without remove() detaches itself: the model can get a new one.
        self._finalizer = weakref.finalize(
            self, uninstall, set(self._implementations), list(self._recorders)
        )

    def _check_covered(self, name: str, param: Tensor) -> None:
        """The group must hold every rank with a shard (or a replica) of ``param``: ranks
        left out would scale their copy by other maxima, and the model would diverge."""
        if not hasattr(param, "device_mesh") or self._group is None:
            return
        holders = set(param.device_mesh.mesh.flatten().tolist())
        members = set(dist.get_process_group_ranks(self._group))
        missing = sorted(holders - members)
        if missing:
            raise ValueError(
                f"{name} lies on ranks {sorted(holders)}, but process_group has "
                f"{sorted(members)}: ranks {missing} would clip with other maxima; pass a group "
                "with every rank that holds the model (the default, the world, does)"
            )

    # ------------------------------------------------------------------------- settings

    @property
    def threshold(self) -> float | None:
        """tau (``None``: record only); set it on every rank alike (``apply()`` refuses ranks
        that differ)."""
        return self._threshold

    @threshold.setter
    def threshold(self, value: float | None) -> None:
        self._threshold, _ = check_qk_clip_settings(value, self._alpha)

    @property
    def record_only(self) -> bool:
        """Whether this clip only measures (``threshold`` is ``None``)."""
        return self._threshold is None

    @property
    def alpha(self) -> float:
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        _, self._alpha = check_qk_clip_settings(self._threshold, value)

    # ------------------------------------------------------------------ recording switch

    @property
    def recording(self) -> bool:
        return self._recorders[0].enabled

    @recording.setter
    def recording(self, enabled: bool) -> None:
        for recorder in self._recorders:
            recorder.enabled = bool(enabled)

    def remove(self) -> None:
        """Stop recording for good and restore the attention functions (idempotent; also
        done when the clip is garbage-collected)."""
        self._finalizer()

    # ------------------------------------------------------------------------ agreement

    def _digest(self) -> tuple[float, float]:
        text = repr(
            [(lay.name, lay.num_heads, lay.num_kv_heads, lay.head_dim, lay.qk_norm)
             for lay in self.layers]
        )  # fmt: skip
        crc = zlib.crc32(text.encode())
        return float(crc >> 16), float(crc & 0xFFFF)

    def _settings_fields(self, failed: bool = False) -> list[float]:
        """A failure flag, then each setting and its negation: after a MAX all-reduce,
        ``a == -b`` on every pair if and only if every rank had the same value."""
        if failed:
            return [1.0] + [0.0] * 8
        fields = [0.0]
        # Thresholds are > 0, so 0 stands for record only.
        threshold = 0.0 if self._threshold is None else self._threshold
        for value in (threshold, self._alpha, *self._digest()):
            fields += [value, -value]
        return fields

    def _check_agreement(
        self, fields: list[float] | Tensor, when: str, error: Exception | None = None
    ) -> None:
        if not isinstance(fields, Tensor):
            if self._group is None or dist.get_world_size(self._group) == 1:
                if error is not None:
                    raise error
                return
            fields = torch.tensor(fields, dtype=torch.float64, device=self._device())
            dist.all_reduce(fields, op=dist.ReduceOp.MAX, group=self._group)
        if error is not None:
            raise error
        values = fields.tolist()
        if values[0]:
            raise ValueError(
                f"QKClip failed on another rank {when} (its error says why); every rank must "
                "build QKClip on the same model with the same settings"
            )
        values = values[1:]
        labels = ("threshold", "alpha", "layer list", "layer list")
        for label, (largest, negated) in zip(labels, zip(values[::2], values[1::2])):
            if largest != -negated:
                shown = (
                    "" if label == "layer list" else f" (largest {largest}, smallest {-negated})"
                )
                raise ValueError(
                    f"ranks disagree on the QK-clip {label}{shown} {when}: every rank must "
                    "build QKClip on the same model with the same settings"
                )

    def _device(self) -> torch.device:
        if not self.layers:  # construction failed on this rank: any device the group takes
            backend = dist.get_backend(self._group) if self._group is not None else "gloo"
            return (
                torch.device("cuda", torch.cuda.current_device())
                if backend == "nccl"
                else torch.device("cpu")
            )
        return local_tensor(self.layers[0].q_module.weight).device

    # ---------------------------------------------------------------------------- apply

    def apply(self, *, scale: bool = True) -> QKClipStats:
        """Reduce the recorded maxima over the ranks (one all-reduce), scale the query and
        key rows of every head above the target (the threshold less its rounding slack),
        reset the records; returns (and keeps as ``last_stats``) what it saw and did.
        ``scale=False`` only measures (the stats count the heads it would clip); a
        record-only clip (``threshold=None``) never scales and counts none. Raises on
        every rank alike when no forward pass was recorded, when a layer recorded nothing
        while others did, or when a max logit is not finite."""
        synchronize_all()  # an overlapped optimizer step still writing the weights
        self._check_implementations()
        device = self._device()
        parts = []
        for recorder in self._recorders:
            maxima = recorder.maxima
            if maxima is None:
                maxima = torch.full((recorder.layer.num_heads,), -math.inf, device=device)
            parts.append(maxima.to(device=device, dtype=torch.float64))
        # Each layer's recording precision rides along, so every rank aims at the same target.
        roundoffs = [r.roundoff for r in self._recorders]
        parts.append(torch.tensor(roundoffs, dtype=torch.float64, device=device))
        fields = torch.tensor(self._settings_fields(), dtype=torch.float64, device=device)
        packed = torch.cat([*parts, fields])
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self._group)
        self._check_agreement(packed[-len(fields) :], "at apply()")
        *maxima_per_layer, roundoffs = packed[: -len(fields)].split(
            [lay.num_heads for lay in self.layers] + [len(self.layers)]
        )
        for recorder in self._recorders:
            recorder.reset()
        self._check_maxima(tuple(maxima_per_layer))
        stats = tuple(
            self._clip_layer(layer, maxima, float(roundoff), scale)
            for layer, maxima, roundoff in zip(self.layers, maxima_per_layer, roundoffs.tolist())
        )
        self.last_stats = QKClipStats(self.threshold, stats)
        return self.last_stats

    def _check_implementations(self) -> None:
        """Local and alike on every rank (the model's settings): before any collective."""
        model = self._model()
        if model is None:
            return
        now = {implementation_of(layer, model) for layer in self.layers}
        if not now <= self._implementations:
            raise RuntimeError(
                f"the model's attention implementation changed to {sorted(now)} after QKClip "
                f"was built (it records through {sorted(self._implementations)}); call "
                "remove() and build a new QKClip"
            )

    def _check_maxima(self, maxima_per_layer: tuple[Tensor, ...]) -> None:
        seen = [bool((m > -math.inf).any()) for m in maxima_per_layer]
        if not any(seen):
            raise RuntimeError(
                "QKClip.apply(): no forward pass was recorded since the last apply() on any "
                "rank (recording off, the model in eval mode, or no forward run)"
            )
        silent = [lay.name for lay, s in zip(self.layers, seen) if not s]
        new = [name for name in silent if name not in self._warned]
        if new:
            # A layer that did not run this step (a vision tower on a text-only batch) is
            # left as it is; one that never records bypasses the attention functions.
            self._warned.update(new)
            warnings.warn(
                f"QKClip.apply(): {', '.join(new[:3])}{' ...' if len(new) > 3 else ''} recorded "
                "nothing while other layers did, so it is not clipped this step: it did not run, "
                "or its attention does not go through Hugging Face's attention functions",
                stacklevel=3,
            )
        bad = [lay.name for lay, m in zip(self.layers, maxima_per_layer) if (m == math.inf).any()]
        if bad:
            raise RuntimeError(
                f"QKClip.apply(): a max logit of {', '.join(bad[:3])} is not finite (inf or "
                "nan): the model has diverged; nothing was scaled"
            )

    def _clip_layer(
        self, layer: AttentionLayer, maxima: Tensor, roundoff: float, scale: bool
    ) -> LayerClipStats:
        if self._threshold is None:
            logits = tuple(maxima.tolist())
            return LayerClipStats(layer.name, logits, 0, 1.0, logits)
        # Measured and rounded logits land a few roundoffs either side of where they are
        # aimed: aim that far below tau, so that the rounded weights' logits stay below it.
        weights = max(unit_roundoff(param.dtype) for _, param in _targets(layer))
        target = self.threshold * (1.0 - rounding_slack(roundoff, weights))
        gammas = head_gammas(maxima, target)
        clipped = int((gammas < 1).sum())
        smallest = float(gammas.min()) if clipped else 1.0
        if layer.qk_norm:
            q_heads = torch.full_like(gammas, smallest**self.alpha)
            k_heads = torch.full(
                (layer.num_kv_heads,), smallest ** (1 - self.alpha), dtype=torch.float64
            )
        else:
            q_heads = query_factors(gammas, self.alpha)
            k_heads = key_factors(gammas, layer.num_kv_heads, self.alpha)
        group = layer.num_heads // layer.num_kv_heads
        after = maxima * q_heads * k_heads.repeat_interleave(group) if clipped else maxima
        stats = LayerClipStats(
            layer.name, tuple(maxima.tolist()), clipped, smallest, tuple(after.tolist()), target
        )
        if not (clipped and scale):
            return stats
        if layer.qk_norm:
            scale_whole_(layer.q_norm.weight, smallest**self.alpha)
            scale_whole_(layer.k_norm.weight, smallest ** (1.0 - self.alpha))
            return stats
        rows: dict[nn.Module, Tensor] = {}
        q_rows = row_factors(q_heads, layer.head_dim)
        k_rows = row_factors(k_heads, layer.head_dim)
        for module, start, factors in (
            (layer.q_module, layer.q_start, q_rows),
            (layer.k_module, layer.k_start, k_rows),
        ):
            if module not in rows:
                rows[module] = torch.ones(module.weight.shape[0], dtype=torch.float64)
            rows[module][start : start + factors.numel()] = factors
        for module, factors in rows.items():
            scale_rows_(module.weight, factors)
            if getattr(module, "bias", None) is not None:
                scale_rows_(module.bias, factors)
        return stats
