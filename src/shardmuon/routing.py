"""Parameter routing: which parameters Muon orthogonalizes, in which group, and how fused
weights are split.

The rule is prime-rl's (``_create_muon_optimizer``), so that group order, and therefore the
integer ids in ``state_dict()["state"]``, match dion checkpoints:

* a trainable parameter goes to Muon when ``ndim >= 2`` and it is neither an embedding
  table nor an output head; everything else (norms, biases, embeddings, the output head)
  goes to the ``adamw`` group. Given the model, embeddings and heads are found from its
  modules (``nn.Embedding``, ``get_output_embeddings()``, an ``nn.Linear`` onto the
  vocabulary); given names, by prime-rl's ``lm_head`` and ``embed_tokens`` substrings and
  the other families' names (``_EMBEDDING_COMPONENTS``, torchtitan's top-level ``output``);
* among the Muon parameters, MoE expert stacks get their own group, routers get their own
  group, and the rest form the main group;
* groups come in the order main Muon, experts, router, adamw; a group with no parameter
  is left out;
* with ``embedding_update="sinkhorn"``, the 2-D embedding tables and output heads
  (``embed_tokens``, ``lm_head``) go to a ``sinkhorn`` group instead (prime-rl's Sinkhorn
  update, ``ops/sinkhorn.py``), placed before the adamw group.

Names are matched on their dotted components, so wrapper prefixes (``_orig_mod.`` from
``torch.compile``, ``module.`` from DDP, ``_checkpoint_wrapped_module.``) do not matter,
and FSDP2's ``fully_shard`` keeps names unchanged. Shapes are read from ``param.shape``,
which for a DTensor is the global shape.

What Hugging Face transformers 5.24 names (checked on tiny random-init models):

* Experts are 3-D stacks ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj`` ``[E, H, I]`` (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4-MoE,
  OLMoE, Qwen2-MoE...). The forward is ``linear(x, gate_up_proj[e]).chunk(2, dim=-1)``:
  the first ``I`` rows are the gate, the next ``I`` rows the up projection, contiguous, not
  interleaved. Dense fused MLPs (Phi-3 ``mlp.gate_up_proj.weight`` ``[2I, H]``) use the same
  halves. GPT-OSS, Llama-4 and Aria store ``gate_up_proj`` as ``[E, H, 2I]`` (input first;
  GPT-OSS also interleaves gate/up columns); a split along rows cannot express that, so
  such a stack is left whole (the sibling ``down_proj`` shape tells the two layouts apart).
* Routers: ``mlp.gate.weight`` ``[E, H]`` (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE,
  DeepSeek-V3, GLM-4-MoE), ``mlp.router.weight`` (GPT-OSS, and prime-rl's own models),
  ``feed_forward.router.weight`` (Llama-4), ``mlp.gate.wg.weight`` (HunYuan-MoE). A router
  is any name with a component exactly ``router`` or ``gate``; ``gate_proj``,
  ``gate_up_proj`` and ``shared_expert_gate`` (Qwen2-MoE's ``[1, H]`` shared-expert gate)
  are not routers and stay in the main group. DeepSeek-V3's ``e_score_correction_bias`` is
  a buffer, not a parameter.
* Shared experts (``mlp.shared_experts.*``) are ordinary dense MLPs: main group.

Known quirk kept for prime-rl compatibility: GPT-OSS's 2-D expert biases
(``mlp.experts.gate_up_proj_bias`` ``[E, 2I]``) have ``ndim >= 2`` and so go to the expert
Muon group, as they do in prime-rl.

Fused QKV: with head counts given, a contiguous ``[Q; K; V]`` weight (``qkv_proj`` as in
Phi-3, ``Wqkv`` as in DBRX/MPT, ``qkv``, ``in_proj_weight`` of ``nn.MultiheadAttention``)
is split into ``(heads*head_dim, kv_heads*head_dim, kv_heads*head_dim)`` rows.
``query_key_value`` (GPT-NeoX, Falcon, Bloom interleave Q/K/V per head) and ``c_attn``
(GPT-2's ``Conv1D`` is stored ``[in, out]``; GPT-BigCode interleaves per head in its
multi-head variant) cannot be split into contiguous row blocks, so asking to partition
them raises ``ValueError`` rather than orthogonalizing the wrong blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from shardmuon.ops.update import ADJUST_LR_CHOICES

__all__ = [
    "ADAMW",
    "MUON",
    "MUON_EXPERTS",
    "MUON_ROUTER",
    "SINKHORN",
    "RoutedParams",
    "build_param_groups",
    "fused_qkv_partition",
    "gate_up_partition",
    "route_name",
]

# The label (in RoutedParams.labels) of the main Muon group's parameters.
MUON = "muon"
# The label of MoE expert stacks: a Muon group of their own.
MUON_EXPERTS = "muon_experts"
# The label of routers: a Muon group of their own.
MUON_ROUTER = "muon_router"
# The label of the AdamW group: norms, biases, embeddings, the output head.
ADAMW = "adamw"
# The label of embeddings and output heads under ``embedding_update="sinkhorn"``.
SINKHORN = "sinkhorn"
GROUP_ORDER = (MUON, MUON_EXPERTS, MUON_ROUTER, SINKHORN, ADAMW)
EMBEDDING_UPDATES = ("adamw", "sinkhorn")

# Embedding tables and output heads of other model families, matched on whole name
# components: GPT-2 (``wte``, ``wpe``), torchtitan (``tok_embeddings``), BERT-style
# (``word_embeddings``, ``position_embeddings``), GPT-NeoX (``embed_in``, ``embed_out``),
# OPT/BART (``embed_positions``). torchtitan's head is a top-level ``output`` (``output.weight``
# once wrapper prefixes are dropped); ``output`` elsewhere (BERT's ``attention.output``) is not.
_POSITION_COMPONENTS = frozenset({"wpe", "position_embeddings", "embed_positions"})
_EMBEDDING_COMPONENTS = _POSITION_COMPONENTS | frozenset(
    {"wte", "tok_embeddings", "word_embeddings", "embed_in", "embed_out"}
)
_WRAPPER_COMPONENTS = frozenset(
    {"_orig_mod", "module", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
)
_ROUTER_COMPONENTS = frozenset({"router", "gate"})
_EXPERT_COMPONENTS = frozenset({"experts"})
# Fused Q/K/V names whose Hugging Face layout is contiguous [Q; K; V] rows.
_CONTIGUOUS_QKV = frozenset({"qkv_proj", "Wqkv", "qkv", "in_proj_weight"})
# Fused Q/K/V names whose layout is not contiguous rows (see the module docstring).
_NONCONTIGUOUS_QKV = {
    "query_key_value": "GPT-NeoX, Falcon and Bloom interleave Q, K and V per head",
    "c_attn": (
        "GPT-2 stores it as Conv1D [in, out] and GPT-BigCode interleaves Q, K and V per head"
    ),
}


@dataclass
class RoutedParams:
    """Output of :func:`build_param_groups`.

    ``groups``: param-group dicts ready for ``Muon(params=groups, ...)``.
    ``partitions``: ``{param: row counts along dim -2}`` for ``Muon(matrix_partitions=...)``.
    ``labels``: ``{name: "muon" | "muon_experts" | "muon_router" | "sinkhorn" | "adamw"}`` for every
    routed (trainable) parameter, in the order the names were given.
    """

    groups: list[dict]
    partitions: dict[Tensor, tuple[int, ...]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    # Why each routed parameter went where it did, and its (global) shape.
    reasons: dict[str, str] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def summary(self) -> str:
        """One line per routed parameter: its name, shape, group and why."""
        rows = [("parameter", "shape", "group", "why")]
        for name, label in self.labels.items():
            shape = "x".join(map(str, self.shapes.get(name, ()))) or "scalar"
            rows.append((name, shape, label, self.reasons.get(name, "")))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3]
            for row in rows
        )


def _components(name: str) -> list[str]:
    return name.split(".")


def route_name(name: str, ndim: int) -> str:
    """Label of one parameter from its name and number of dims.

    prime-rl's substrings (``mlp.experts``, ``mlp.router``) plus whole name components
    (``experts``; ``router`` or ``gate``) for the Hugging Face names listed in the module
    docstring. Experts win over routers, as in prime-rl.
    """
    if ndim < 2 or _embedding_by_name(name):
        return ADAMW
    parts = _components(name)
    if "mlp.experts" in name or _EXPERT_COMPONENTS.intersection(parts):
        return MUON_EXPERTS
    if "mlp.router" in name or _ROUTER_COMPONENTS.intersection(parts):
        return MUON_ROUTER
    return MUON


def _embedding_by_name(name: str) -> bool:
    """An embedding table or output head by its name: prime-rl's substrings (``lm_head``,
    ``embed_tokens``) or another family's component (:data:`_EMBEDDING_COMPONENTS`,
    torchtitan's top-level ``output``)."""
    if "lm_head" in name or "embed_tokens" in name:
        return True
    parts = [p for p in _components(name) if p not in _WRAPPER_COMPONENTS]
    return bool(_EMBEDDING_COMPONENTS.intersection(parts)) or parts == ["output", "weight"]


def _token_table(name: str) -> bool:
    """Of an embedding or head found by name: a vocabulary-sized one (not positions)."""
    return not _POSITION_COMPONENTS.intersection(_components(name))


def _is_embedding(name: str, ndim: int) -> bool:
    """An embedding table or output head by name (2-D only)."""
    return ndim == 2 and _embedding_by_name(name)


def gate_up_partition(
    shape: Sequence[int], down_shape: Sequence[int] | None = None
) -> tuple[int, int] | None:
    """Row split ``(I, I)`` of a fused ``gate_up_proj`` of shape ``[..., 2I, H]``, or ``None``.

    ``down_shape`` is the sibling ``down_proj`` shape when known: ``[..., H, I]`` confirms the
    ``[2I, H]`` layout; any other shape (e.g. GPT-OSS's ``[E, I, H]`` next to a
    ``[E, H, 2I]`` gate_up) means the halves are columns, which a row split cannot express.
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    if rows % 2:
        return None
    half = rows // 2
    if down_shape is not None and (int(down_shape[-1]), int(down_shape[-2])) != (half, cols):
        return None
    return (half, half)


def fused_qkv_partition(
    name: str,
    shape: Sequence[int],
    *,
    num_attention_heads: int,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
) -> tuple[int, int, int]:
    """Row split ``(heads*head_dim, kv_heads*head_dim, kv_heads*head_dim)`` of a fused QKV.

    ``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention);
    ``head_dim`` defaults to ``rows / (heads + 2*kv_heads)``. Raises ``ValueError`` when the
    weight's rows do not match the head counts, or when the name is one whose layout is not
    contiguous ``[Q; K; V]`` rows.
    """
    _check_head_counts(num_attention_heads, num_key_value_heads, head_dim)
    kv_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
    for part in _components(name):
        if part in _NONCONTIGUOUS_QKV:
            raise ValueError(
                f"cannot partition fused QKV {name!r} of shape {tuple(shape)}: "
                f"{_NONCONTIGUOUS_QKV[part]}, so Q, K and V are not contiguous row blocks; "
                "matrix_partitions only splits contiguous rows. Leave the head counts out "
                "to orthogonalize it as one matrix."
            )
    if len(shape) < 2:
        raise ValueError(f"fused QKV {name!r} must be a matrix, got shape {tuple(shape)}")
    rows = int(shape[-2])
    total_heads = num_attention_heads + 2 * kv_heads
    if head_dim is None:
        if rows % total_heads:
            raise ValueError(
                f"fused QKV {name!r} of shape {tuple(shape)}: {rows} rows are not a multiple "
                f"of heads + 2*kv_heads = {num_attention_heads} + 2*{kv_heads} = {total_heads}; "
                "pass head_dim or check the head counts"
            )
        head_dim = rows // total_heads
    _check_positive_int("head_dim", head_dim)
    split = (num_attention_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    if sum(split) != rows:
        hint = ""
        if int(shape[-1]) == sum(split):
            hint = " (its columns match: the weight looks stored as [in, out], e.g. Conv1D)"
        raise ValueError(
            f"fused QKV {name!r} of shape {tuple(shape)} does not match the head counts: "
            f"expected {sum(split)} rows = ({num_attention_heads} + 2*{kv_heads}) heads * "
            f"head_dim {head_dim}, got {rows}{hint}"
        )
    return split


def _check_head_counts(heads: int, kv_heads: int | None, head_dim: int | None) -> None:
    _check_positive_int("num_attention_heads", heads)
    if kv_heads is not None:
        _check_positive_int("num_key_value_heads", kv_heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads={heads} must be a multiple of num_key_value_heads={kv_heads}"
            )
    if head_dim is not None:
        _check_positive_int("head_dim", head_dim)


def _check_positive_int(field_name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{field_name} must be a positive int, got {value!r}")


def _is_fused_qkv(parts: list[str]) -> bool:
    return any(p in _CONTIGUOUS_QKV or p in _NONCONTIGUOUS_QKV for p in parts)


def _sibling_down_shape(name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    parts = _components(name)
    idx = parts.index("gate_up_proj")
    sibling = ".".join([*parts[:idx], "down_proj", *parts[idx + 1 :]])
    return shapes.get(sibling)


def _partition_for(
    name: str,
    shape: tuple[int, ...],
    shapes: dict[str, tuple[int, ...]],
    heads: tuple[int | None, int | None, int | None],
) -> tuple[int, ...] | None:
    parts = _components(name)
    if "gate_up_proj" in parts:
        return gate_up_partition(shape, _sibling_down_shape(name, shapes))
    num_heads, kv_heads, head_dim = heads
    if num_heads is not None and _is_fused_qkv(parts):
        return fused_qkv_partition(
            name,
            shape,
            num_attention_heads=num_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
        )
    return None


def _embeddings_of(model: nn.Module) -> tuple[dict[int, str], set[int]]:
    """``({id(param): why}, vocabulary sizes)`` of the embedding tables and output heads
    read from ``model``'s modules: every ``nn.Embedding`` (and subclass); the model's
    ``get_output_embeddings()`` (Hugging Face); an ``nn.Linear`` mapping the input
    embedding's width to its vocabulary (torchtitan's ``output``). Tied heads are the
    embedding's own parameter."""
    found: dict[int, str] = {}
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    for name, module in embeddings:
        found[id(module.weight)] = f"embedding ({type(module).__name__} {name or 'model'})"
    table = _call_quietly(model, "get_input_embeddings")
    if not isinstance(table, nn.Embedding) and embeddings:
        table = max((m for _, m in embeddings), key=lambda m: m.num_embeddings)
    vocab = {table.num_embeddings} if isinstance(table, nn.Embedding) else set()
    head = getattr(_call_quietly(model, "get_output_embeddings"), "weight", None)
    if isinstance(head, Tensor):
        if id(head) not in found:
            found[id(head)] = "output head (the model's get_output_embeddings())"
        return found, vocab  # the model names its head: no guessing
    if isinstance(table, nn.Embedding):
        onto_vocab = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            and (module.out_features, module.in_features)
            == (table.num_embeddings, table.embedding_dim)
            and id(module.weight) not in found
        ]
        # Several (an MLP as wide as the vocabulary): only a child of the root is the head.
        if len(onto_vocab) > 1:
            onto_vocab = [(n, m) for n, m in onto_vocab if "." not in n]
        if len(onto_vocab) == 1:
            name, module = onto_vocab[0]
            found[id(module.weight)] = (
                f"output head (nn.Linear {name} onto the {table.num_embeddings}-entry vocabulary)"
            )
    return found, vocab


def _call_quietly(model: nn.Module, method: str):
    """``model.method()`` if it has one that works, else ``None``."""
    fn = getattr(model, method, None)
    if not callable(fn):
        return None
    try:
        return fn()
    except (NotImplementedError, AttributeError, TypeError):
        return None


def _why(label: str, ndim: int) -> str:
    if ndim < 2:
        return f"{ndim}-D: not a matrix"
    return {
        ADAMW: "embedding or output head (by name)",
        SINKHORN: "embedding or output head (by name)",
        MUON_EXPERTS: "expert stack (by name)",
        MUON_ROUTER: "router (by name)",
    }.get(label, "matrix")


def build_param_groups(
    named_params: Iterable[tuple[str, Tensor]] | nn.Module,
    *,
    lr: float,
    weight_decay: float,
    adjust_lr: str | None = "rms_norm",
    expert_mesh_name: str | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    partition_fused: bool = True,
    embedding_update: str = "adamw",
) -> RoutedParams:
    """Route ``named_params`` (``model.named_parameters()``, or the model itself) into Muon
    param groups.

    Given the model, embeddings and output heads are found by what they are (module type,
    the model's output embeddings, a linear map onto the vocabulary), names as a fallback;
    given names, by name (prime-rl's ``embed_tokens``/``lm_head`` and the other families'
    listed in the module docstring; only the names ``named_params`` yields: a tied table is
    one name there), and a matrix with a vocabulary-sized dim routed to Muon warns.
    ``RoutedParams.summary()`` says where each parameter went and why.

    Frozen parameters (``requires_grad=False``) are left out; a tensor given twice under two
    names is routed once, under its first name. Group dicts follow prime-rl:
    muon ``{params, algorithm="muon", lr, weight_decay, adjust_lr}``, experts the same plus
    ``distributed_mesh_name=expert_mesh_name``, router as muon, adamw
    ``{params, algorithm="adamw", lr, weight_decay}``.

    ``partitions`` holds the fused weights recognised (see the module docstring): a
    ``gate_up_proj`` ``[..., 2I, H]`` -> ``(I, I)``; a fused QKV -> ``(q, k, v)`` rows, only
    when ``num_attention_heads`` is given. ``partition_fused=False`` returns no partitions
    (dion never partitions, so bitwise parity with dion checkpoints needs this).

    ``embedding_update``: ``"adamw"`` (default, prime-rl's routing) or ``"sinkhorn"``: 2-D
    ``embed_tokens``/``lm_head`` parameters form a ``{params, algorithm="sinkhorn", lr}``
    group (prime-rl's Sinkhorn defaults; no weight decay), labelled ``"sinkhorn"``.
    """
    if embedding_update not in EMBEDDING_UPDATES:
        raise ValueError(
            f"embedding_update must be one of {EMBEDDING_UPDATES!r}, got {embedding_update!r}"
        )
    if adjust_lr not in ADJUST_LR_CHOICES:
        raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES!r}, got {adjust_lr!r}")
    if num_attention_heads is None and (num_key_value_heads is not None or head_dim is not None):
        raise ValueError(
            "num_key_value_heads/head_dim were given without num_attention_heads "
            f"(got num_key_value_heads={num_key_value_heads!r}, head_dim={head_dim!r}); "
            "pass num_attention_heads too"
        )
    if num_attention_heads is not None:
        _check_head_counts(num_attention_heads, num_key_value_heads, head_dim)
    by_module: dict[int, str] = {}
    vocab: set[int] = set()
    from_model = isinstance(named_params, nn.Module)
    if from_model:
        by_module, vocab = _embeddings_of(named_params)
        named_params = named_params.named_parameters()
    named = list(named_params)
    # Shapes of every parameter, frozen ones included: a frozen down_proj still tells
    # which layout its gate_up_proj sibling has.
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in named:
        if not isinstance(name, str) or not isinstance(param, Tensor):
            raise TypeError(
                "named_params must yield (str, Tensor) pairs, got "
                f"({type(name).__name__}, {type(param).__name__})"
            )
        shapes[name] = tuple(param.shape)

    members: dict[str, list[Tensor]] = {label: [] for label in GROUP_ORDER}
    labels: dict[str, str] = {}
    reasons: dict[str, str] = {}
    partitions: dict[Tensor, tuple[int, ...]] = {}
    seen: set[int] = set()
    heads = (num_attention_heads, num_key_value_heads, head_dim)
    # Every name of each tensor: a tied table is routed once, under its first name, but any
    # of its names may say what it is (T5's shared.weight is also its embed_tokens).
    names_of: dict[int, list[str]] = {}
    for name, param in named:
        names_of.setdefault(id(param), []).append(name)
    for name, param in named:
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if id(param) in by_module and param.ndim >= 2:
            label, reasons[name] = ADAMW, by_module[id(param)]
            embedding = param.ndim == 2
        else:
            aliases = names_of[id(param)]
            by_alias = next((n for n in aliases if _embedding_by_name(n)), name)
            label = route_name(by_alias, param.ndim)
            reasons[name] = _why(label, param.ndim)
            if by_alias != name:
                reasons[name] += f", tied to {by_alias}"
            embedding = _is_embedding(by_alias, param.ndim)
            if embedding and not by_module and _token_table(by_alias):
                vocab.add(int(param.shape[0]))
        if embedding and label == ADAMW and embedding_update == SINKHORN:
            label = SINKHORN
        labels[name] = label
        members[label].append(param)
        if partition_fused and label != ADAMW:
            split = _partition_for(name, shapes[name], shapes, heads)
            if split is not None:
                partitions[param] = split

    muon_opts = {"algorithm": "muon", "lr": lr, "weight_decay": weight_decay}
    specs = {
        MUON: {**muon_opts, "adjust_lr": adjust_lr},
        MUON_EXPERTS: {
            **muon_opts,
            "adjust_lr": adjust_lr,
            "distributed_mesh_name": expert_mesh_name,
        },
        MUON_ROUTER: {**muon_opts, "adjust_lr": adjust_lr},
        SINKHORN: {"algorithm": "sinkhorn", "lr": lr},
        ADAMW: {"algorithm": "adamw", "lr": lr, "weight_decay": weight_decay},
    }
    groups = [{"params": members[label], **specs[label]} for label in GROUP_ORDER if members[label]]
    if not from_model:  # the modules say what is a table or a head: no guessing
        _warn_vocabulary_sized(labels, shapes, vocab)
    return RoutedParams(
        groups=groups,
        partitions=partitions,
        labels=labels,
        reasons=reasons,
        shapes={name: shapes[name] for name in labels},
    )


_SMALLEST_WARNED_VOCAB = 1000


def _warn_vocabulary_sized(
    labels: dict[str, str], shapes: dict[str, tuple[int, ...]], vocab: set[int]
) -> None:
    """Warn of Muon matrices with a vocabulary-sized dim (a vocabulary of at least
    :data:`_SMALLEST_WARNED_VOCAB` entries: smaller ones coincide with other widths of small
    test models): likely an embedding or output head that neither its module nor its name
    gave away."""
    vocab = {v for v in vocab if v >= _SMALLEST_WARNED_VOCAB}
    suspects = [
        f"{name} {shapes[name]}"
        for name, label in labels.items()
        if label in (MUON, MUON_ROUTER)
        and len(shapes[name]) == 2
        and vocab.intersection(shapes[name])
    ]
    if suspects:
        warnings.warn(
            f"{len(suspects)} matrix(es) with a vocabulary-sized dim ({sorted(vocab)}) go to "
            f"Muon: {', '.join(suspects[:4])}{' ...' if len(suspects) > 4 else ''}. If they "
            "are embeddings or output heads, pass the model (build_param_groups(model, ...)) "
            "or give their group yourself ({'params': [...], 'algorithm': 'adamw'})",
            UserWarning,
            stacklevel=3,
        )
