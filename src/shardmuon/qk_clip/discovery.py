"""Finding the attention layers QK-clip can act on, and what to scale in each.

A layer is a module with ``q_proj`` and ``k_proj`` (Llama, Qwen, Mistral, GLM, ...) or one
fused ``qkv_proj``/``Wqkv`` whose rows are ``[Q; K; V]`` (Phi-3; the row split is
:func:`shardmuon.routing.fused_qkv_partition`, the one the optimizer uses). Head counts
come from the module or its config. A model whose heads are normalised after the
projection (Qwen3's ``q_norm``/``k_norm``) is clipped through the norms' gains, per layer
(see :class:`AttentionLayer`). A layer is kept only if its ``forward`` dispatches through
transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``), where its logits are
recorded: one that computes its own scores (GPT-Neo, MPT, XGLM) would record nothing.
Everything else that looks like attention is refused with its name: MLA (DeepSeek's
``kv_a_proj_with_mqa``), ``[in, out]`` weights (GPT-2's ``Conv1D``), interleaved fused QKV
(Falcon, GPT-NeoX, CodeGen's model-parallel blocks).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass

import torch
from torch import nn

from shardmuon.routing import fused_qkv_partition

__all__ = ["AttentionLayer", "find_attention_layers"]

_FUSED_NAMES = ("qkv_proj", "Wqkv", "query_key_value", "c_attn")
_INTERLEAVED = {
    "query_key_value": "GPT-NeoX, Falcon and Bloom interleave Q, K and V per head",
    "c_attn": "GPT-BigCode interleaves Q, K and V per head",
}
_MLA_MARKERS = ("kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj")


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: where its query and key rows are, and its head shape.

    ``q_module``/``k_module``: the linear modules holding the query / key rows, from row
    ``q_start``/``k_start`` (the same module for fused QKV). ``q_norm``/``k_norm``: the
    per-head norms applied after the projections, or ``None``; with them, scaling rows does
    nothing (the norm undoes it), so the clip scales the norms' gains instead, by the layer's
    smallest gamma (one gain vector serves every head).
    """

    name: str
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_module: nn.Module
    q_start: int
    k_module: nn.Module
    k_start: int
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    @property
    def qk_norm(self) -> bool:
        return self.q_norm is not None


def _config_value(module: nn.Module, model: nn.Module, *keys: str) -> int | None:
    for source in (module, getattr(module, "config", None), getattr(model, "config", None)):
        if source is None:
            continue
        for key in keys:
            value = getattr(source, key, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _rows(module: nn.Module, name: str) -> int:
    weight = getattr(module, "weight", None)
    if weight is None or weight.ndim != 2:
        raise ValueError(f"{name} has no 2-D weight: QK-clip scales the rows of one")
    if type(module).__name__ == "Conv1D":
        raise ValueError(
            f"{name} is a Conv1D, whose weight is stored [in, out]: QK-clip scales the rows of "
            "[out, in] weights (nn.Linear) and cannot scale this one"
        )
    return int(weight.shape[0])  # a DTensor's shape is the global one


def _head_shape(name: str, module: nn.Module, model: nn.Module) -> tuple[int, int, int | None]:
    heads = _config_value(module, model, "num_heads", "num_attention_heads")
    if heads is None:
        raise ValueError(
            f"{name}: no head count found (num_heads / num_attention_heads on the module or "
            "its config); pass a model whose config has it"
        )
    kv_heads = _config_value(module, model, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = _config_value(module, model, "head_dim")
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"{name}: {heads} attention heads do not divide into {kv_heads} key/value heads"
        )
    return heads, kv_heads, head_dim


def _check_rows(name: str, part: str, rows: int, heads: int, head_dim: int) -> None:
    expected = heads * head_dim
    if rows != expected:
        hint = "the heads do not divide the projection rows as the config says"
        if rows % expected == 0:
            hint = (
                f"{rows // expected}x what the heads need: a gated or otherwise extended "
                "projection, which QK-clip cannot split into heads"
            )
        raise ValueError(
            f"{name}: {part} has {rows} rows, not heads x head_dim = {heads} x {head_dim} = "
            f"{expected}; {hint}"
        )


_NORM_ALIASES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"))


def _present(norm: nn.Module | None) -> nn.Module | None:
    """``norm`` unless it is absent in effect (``None``, ``nn.Identity``)."""
    return None if norm is None or isinstance(norm, nn.Identity) else norm


def _gain_is_multiplicative(norm: nn.Module) -> bool:
    """Whether scaling ``norm``'s gain by ``s`` scales its output by ``s`` (``x / rms(x) * w``,
    not Gemma's ``x * (1 + w)`` nor a LayerNorm with a bias): probed on a copy of the module
    with a plain random gain, so it needs neither the real weights nor a collective."""
    import copy

    weight = norm.weight
    try:
        probe = copy.deepcopy(norm).to("cpu")
        gain = torch.rand(tuple(weight.shape), generator=torch.Generator().manual_seed(0)) + 0.5
        x = torch.randn(3, int(weight.shape[-1]), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            # Other parameters (a bias) at values training could give them, not their init.
            for name, param in list(probe.named_parameters()):
                if name != "weight" and "." not in name:
                    setattr(probe, name, nn.Parameter(torch.rand(tuple(param.shape)) + 0.5))
            # forward itself: a parallel style's hooks expect DTensors, not the probe's input.
            probe.weight = nn.Parameter(gain.clone())
            once = probe.forward(x).double()
            probe.weight = nn.Parameter(gain * 2)
            twice = probe.forward(x).double()
    except Exception:  # a norm that cannot run alone on the CPU: cannot be vouched for
        return False
    return bool(torch.allclose(twice, 2 * once, rtol=1e-5, atol=1e-6)) and not torch.allclose(
        twice, once
    )


def _norms(name: str, module: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    children = dict(module.named_children())
    for q_key, k_key in _NORM_ALIASES:
        q_norm, k_norm = _present(children.get(q_key)), _present(children.get(k_key))
        if q_norm is not None or k_norm is not None:
            break
    others = sorted(
        n for n, child in children.items()
        if "norm" in n.lower() and _present(child) is not None and n not in (q_key, k_key)
    )  # fmt: skip
    if others:
        raise ValueError(
            f"{name} normalises its queries or keys with {', '.join(others)}, which QK-clip "
            "does not know how to scale (a norm after the projections undoes a row scale)"
        )
    if q_norm is None and k_norm is None:
        return None, None
    if q_norm is None or k_norm is None:
        raise ValueError(
            f"{name} normalises only its {'queries' if q_norm is not None else 'keys'}: QK-clip "
            "needs both norms' gains (or neither) to bound the logits"
        )
    for norm_name, norm in ((q_key, q_norm), (k_key, k_norm)):
        if getattr(norm, "weight", None) is None:
            raise ValueError(
                f"{name}.{norm_name} has no gain (weight): after a norm, scaling the projection "
                "does nothing, and there is no gain to scale instead"
            )
        if not _gain_is_multiplicative(norm):
            raise ValueError(
                f"{name}.{norm_name} ({type(norm).__name__}) does not scale its output with its "
                "gain (e.g. Gemma's x * (1 + w), or a bias): QK-clip can bound the logits of "
                "norms of the form x / rms(x) * w only"
            )
    return q_norm, k_norm


def _names(code: types.CodeType) -> set[str]:
    """The global and attribute names ``code`` and the functions nested in it load."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _runs_through_interface(module: nn.Module) -> bool:
    """Whether ``module``'s forward reaches transformers' attention interface, the one place
    its logits can be recorded: read from the code of the forward that runs (past
    decorators, and up the class chain while it calls ``super()``), not from the class name,
    so any model that computes its own scores is caught."""
    from transformers.modeling_utils import AttentionInterface

    for klass in type(module).__mro__:
        forward = vars(klass).get("forward")
        if klass is nn.Module:
            return False
        if forward is None:
            continue
        forward = inspect.unwrap(forward)
        code = getattr(forward, "__code__", None)
        if code is None:  # not Python code: nothing to read, so nothing to vouch for
            return False
        names = _names(code) | set(code.co_freevars)
        scope = getattr(forward, "__globals__", {})
        cells = {}
        for free, cell in zip(code.co_freevars, forward.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell holds nothing to read
                cells[free] = cell.cell_contents
        # By value too: an alias of ALL_ATTENTION_FUNCTIONS is the same registry.
        if "ALL_ATTENTION_FUNCTIONS" in names or any(
            isinstance(cells[n] if n in cells else scope.get(n), AttentionInterface) for n in names
        ):
            return True
        if "super" not in names:
            return False
    return False


def _check_recordable(name: str, module: nn.Module) -> None:
    if not _runs_through_interface(module):
        raise ValueError(
            f"{name} ({type(module).__name__}) computes its attention scores itself: its forward "
            "does not go through transformers' attention interface (ALL_ATTENTION_FUNCTIONS), "
            "so its logits cannot be recorded and QK-clip cannot bound them; QK-clip supports "
            "attention modules that dispatch through it (Llama, Qwen, Mistral, Phi-3, ...)"
        )


def _layer(name: str, module: nn.Module, model: nn.Module) -> AttentionLayer | None:
    children = dict(module.named_children())
    if any(marker in children for marker in _MLA_MARKERS):
        raise ValueError(
            f"{name} is multi-head latent attention (MLA: {', '.join(sorted(set(children) & set(_MLA_MARKERS)))}); "
            "QK-clip supports attention with per-head query and key projections only"
        )
    fused = next((n for n in _FUSED_NAMES if n in children), None)
    if "q_proj" in children and "k_proj" in children:
        heads, kv_heads, head_dim = _head_shape(name, module, model)
        q_rows = _rows(children["q_proj"], f"{name}.q_proj")
        head_dim = head_dim or q_rows // heads
        _check_rows(name, "q_proj", q_rows, heads, head_dim)
        _check_rows(name, "k_proj", _rows(children["k_proj"], f"{name}.k_proj"), kv_heads, head_dim)
        q_module, k_module, k_start = children["q_proj"], children["k_proj"], 0
    elif fused is not None:
        fused_module = children[fused]
        rows = _rows(fused_module, f"{name}.{fused}")
        blocks = getattr(module, "mp_num", None)
        if fused in _INTERLEAVED or (isinstance(blocks, int) and blocks > 1):
            why = _INTERLEAVED.get(fused) or (
                f"its rows interleave Q, V and K over mp_num = {blocks} model-parallel blocks "
                "(CodeGen)"
            )
            raise ValueError(
                f"{name}.{fused}: {why}, so the query and key rows are not contiguous blocks; "
                "QK-clip scales [Q; K; V] row blocks only"
            )
        heads, kv_heads, head_dim = _head_shape(name, module, model)
        q_rows, _, _ = fused_qkv_partition(
            f"{name}.{fused}.weight",
            (rows, 1),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
        )
        head_dim = q_rows // heads
        q_module = k_module = fused_module
        k_start = q_rows
    else:
        return None
    q_norm, k_norm = _norms(name, module)
    _check_recordable(name, module)
    return AttentionLayer(
        name, module, heads, kv_heads, head_dim, q_module, 0, k_module, k_start, q_norm, k_norm
    )


def find_attention_layers(model: nn.Module) -> list[AttentionLayer]:
    """Every attention layer of ``model``, in module order; ``ValueError`` naming the module
    for one that cannot be clipped, or when there is none."""
    layers = []
    for name, module in model.named_modules():
        layer = _layer(name or type(model).__name__, module, model)
        if layer is not None:
            layers.append(layer)
    if not layers:
        raise ValueError(
            f"no attention layer found in {type(model).__name__}: QK-clip looks for modules "
            f"with q_proj and k_proj, or a fused {' / '.join(_FUSED_NAMES[:2])} ([Q; K; V] rows)"
        )
    return layers
