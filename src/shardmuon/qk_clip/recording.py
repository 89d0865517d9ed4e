"""Recording each head's max logit during the forward pass, through Hugging Face's
attention-function registry.

Hugging Face attention modules call ``ALL_ATTENTION_FUNCTIONS.get_interface(name, eager)``
with the rotated query ``[batch, heads, q_len, head_dim]``, the key before its
grouped-query repeat ``[batch, kv_heads, kv_len, head_dim]``, the mask and the scale. For
each implementation name a recorded model uses (``sdpa``, ``eager``, flash, ...), the entry
is replaced by a wrapper that hands those to the module's :class:`LayerRecorder` (if it
has one) and then calls the original, unchanged; modules without a recorder pass straight
through. ``eager`` has no entry: each module passes its own eager function as the default
(Llama4's and Phi-4-multimodal's vision towers pass other functions than their text
layers), so for it ``get_interface`` itself is wrapped, and the wrapper calls the default
it was given. The model's config is not touched (``save_pretrained`` still writes the real
implementation), and the mask interface needs nothing. When the last recorder is removed
the original entries (and ``get_interface``) come back.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from shardmuon.qk_clip.discovery import AttentionLayer
from shardmuon.qk_clip.logits import max_logits_per_head, recording_roundoff
from shardmuon.qk_clip.shards import head_offset

__all__ = ["LayerRecorder", "check_free", "implementation_of", "install", "uninstall"]

_RECORDERS: weakref.WeakKeyDictionary[nn.Module, LayerRecorder] = weakref.WeakKeyDictionary()
# implementation name -> (the original entry or None for the model's own eager, users)
_INSTALLED: dict[str, tuple[Callable | None, int]] = {}
# While eager is recorded: the get_interface AttentionInterface had (None: inherited, so
# deleting the patch restores it), and a wrapper per default eager function.
_GET_INTERFACE: list[tuple[Callable, Callable | None]] = []
_EAGER_WRAPPERS: dict[Callable, Callable] = {}


class LayerRecorder:
    """One layer's running per-head maximum (``[heads]`` float32, ``-inf`` until a forward
    pass in training mode records it) and the unit roundoff of the coarsest precision it was
    measured in (``roundoff``, 0 until then), kept until :meth:`reset`."""

    def __init__(self, layer: AttentionLayer, chunk_elements: int) -> None:
        self.layer = layer
        self.chunk_elements = chunk_elements
        self.enabled = True
        self.maxima: Tensor | None = None
        self.roundoff = 0.0
        self._offsets: dict[int, int] = {}  # local head count -> first global head

    def reset(self) -> None:
        self.maxima = None
        self.roundoff = 0.0

    def observe(
        self, query: Tensor, key: Tensor, mask: Tensor | None, kwargs: dict, implementation: str
    ) -> None:
        module, layer = self.layer.module, self.layer
        if not (self.enabled and module.training):
            return
        local_heads = query.shape[1]
        offset = 0
        if local_heads != layer.num_heads:
            if local_heads not in self._offsets:  # the placement does not change: once
                self._offsets[local_heads] = head_offset(
                    layer.name, layer.q_module.weight, layer.q_start, layer.head_dim, local_heads
                )
            offset = self._offsets[local_heads]
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", layer.head_dim**-0.5)
        key_padding = segments = None
        if mask is not None and mask.ndim == 2:  # flash's [batch, kv] padding mask
            key_padding, mask = mask, None
        elif mask is not None:
            mask = mask[..., : key.shape[-2]]
        if mask is None and implementation.startswith("flash"):
            segments = _packed_segments(kwargs, query.shape[0], key.shape[-2])
        with torch.no_grad():
            seen = max_logits_per_head(
                query.detach(),
                key.detach(),
                float(scaling),
                mask,
                causal=bool(kwargs.get("is_causal", getattr(module, "is_causal", True))),
                sliding_window=kwargs.get("sliding_window"),
                key_padding=key_padding,
                segments=segments,
                chunk_heads=layer.num_heads,
                chunk_elements=self.chunk_elements,
            ).float()
        if self.maxima is None:
            self.maxima = torch.full(
                (layer.num_heads,), -math.inf, dtype=torch.float32, device=seen.device
            )
        part = self.maxima[offset : offset + local_heads]
        torch.maximum(part, seen.nan_to_num(nan=math.inf), out=part)
        # bf16 activations (autocast, or bf16 weights) measure S_h to ~2^-8 only: the clip
        # must aim that much lower, whatever the weights' own dtype.
        self.roundoff = max(self.roundoff, recording_roundoff(query, key))


def _packed_segments(kwargs: dict, batch: int, kv_len: int) -> Tensor | None:
    """The document of each key position when flash attention runs packed sequences (as
    Hugging Face's flash path detects them: ``cu_seq_lens_k``, or one row whose
    ``position_ids`` restart at 0), else ``None``."""
    bounds = kwargs.get("cu_seq_lens_k")
    if bounds is not None:
        positions = torch.arange(kv_len, device=bounds.device)
        return torch.bucketize(positions, bounds[1:], right=True)[None].expand(batch, kv_len)
    position_ids = kwargs.get("position_ids")
    if position_ids is None or batch != 1 or position_ids.shape[-1] != kv_len:
        return None
    starts = position_ids.reshape(1, -1) == 0
    if not starts[:, 1:].any():
        return None
    return starts.cumsum(dim=-1)


def _wrapper(name: str, original: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        recorder = _RECORDERS.get(module)
        if recorder is not None:
            recorder.observe(query, key, attention_mask, kwargs, name)
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__wrapped__ = original  # type: ignore[attr-defined]
    return attention


def _get_interface(self, attn_implementation: str, default: Callable) -> Callable:
    """``AttentionInterface.get_interface`` while eager is recorded: the registered entry
    as before; for eager with none registered, the caller's own default, wrapped."""
    found = _GET_INTERFACE[0][0](self, attn_implementation, default)
    if attn_implementation != "eager" or found is not default:
        return found
    if default not in _EAGER_WRAPPERS:
        _EAGER_WRAPPERS[default] = _wrapper("eager", default)
    return _EAGER_WRAPPERS[default]


def implementation_of(layer: AttentionLayer, model: nn.Module) -> str:
    """The attention implementation name ``layer``'s module dispatches on."""
    for source in (layer.module, model):
        config = getattr(source, "config", None)
        name = getattr(config, "_attn_implementation", None)
        if name in UNSUPPORTED:
            raise ValueError(
                f"{layer.name} runs attention implementation {name!r}: QK-clip cannot record "
                f"it ({UNSUPPORTED[name]})"
            )
        if name == "eager" and not _eager_is_looked_up():
            raise ValueError(
                f"{layer.name} runs attention implementation 'eager', which this transformers "
                "version calls directly, not through ALL_ATTENTION_FUNCTIONS.get_interface: "
                "QK-clip cannot record it; use sdpa (or flash) attention"
            )
        if name:
            return name
    raise ValueError(
        f"{layer.name}: no attention implementation set (config._attn_implementation); "
        "QK-clip records through Hugging Face's attention functions"
    )


def _eager_is_looked_up() -> bool:
    """Whether models look eager up (``get_interface(name, default)``) rather than calling
    their eager function directly, as older transformers versions did."""
    from transformers.modeling_utils import AttentionInterface

    return hasattr(AttentionInterface, "get_interface")


# Implementations whose inputs the recorder cannot read (flex's BlockMask).
UNSUPPORTED = {
    "flex_attention": "its BlockMask cannot be read here; use sdpa, eager or flash attention"
}


def check_free(layers: list[AttentionLayer]) -> None:
    """``ValueError`` if one of ``layers`` already records for another QKClip."""
    taken = [layer.name for layer in layers if layer.module in _RECORDERS]
    if taken:
        raise ValueError(
            f"{', '.join(taken)} already record for another QKClip; call its remove() first"
        )


def install(names: set[str], recorders: list[LayerRecorder]) -> None:
    """Put the recording wrapper in front of each implementation of ``names`` and attach
    ``recorders`` to their modules; ``ValueError`` if a module already has one."""
    from transformers.modeling_utils import AttentionInterface

    check_free([r.layer for r in recorders])
    for name in sorted(names):
        if name in _INSTALLED:
            original, users = _INSTALLED[name]
            _INSTALLED[name] = (original, users + 1)
            continue
        original = AttentionInterface._global_mapping.get(name)
        if original is None and name != "eager":
            raise ValueError(f"attention implementation {name!r} is not registered")
        if original is None:
            own = vars(AttentionInterface).get("get_interface")
            _GET_INTERFACE.append((AttentionInterface.get_interface, own))
            AttentionInterface.get_interface = _get_interface
        else:
            AttentionInterface.register(name, _wrapper(name, original))
        _INSTALLED[name] = (original, 1)
    for recorder in recorders:
        _RECORDERS[recorder.layer.module] = recorder


def uninstall(names: set[str], recorders: list[LayerRecorder]) -> None:
    """Undo :func:`install`: detach ``recorders``; restore entries no QKClip uses now."""
    from transformers.modeling_utils import AttentionInterface

    for recorder in recorders:
        if _RECORDERS.get(recorder.layer.module) is recorder:
            del _RECORDERS[recorder.layer.module]
    for name in sorted(names):
        if name not in _INSTALLED:
            continue
        original, users = _INSTALLED[name]
        if users > 1:
            _INSTALLED[name] = (original, users - 1)
            continue
        del _INSTALLED[name]
        if original is None:
            _, own = _GET_INTERFACE.pop()
            if own is None:
                del AttentionInterface.get_interface
            else:
                AttentionInterface.get_interface = own
            _EAGER_WRAPPERS.clear()
        else:
            AttentionInterface.register(name, original)
