"""The largest pre-softmax logit of each attention head, and the clip factors it implies
(pure math on plain tensors).

``max_logits_per_head`` never forms a whole score matrix: it walks a bounded block of the
batch's queries at a time (a few whole short sequences, or part of a long one), so its
memory is ``chunk_elements`` scores plus O(heads). Each (sequence, head) block of scores is
one matrix product whose shape depends only on the sequence lengths and the *global* head
count, so every rank of a data- or tensor-parallel job computes each score as one process
seeing the whole batch does: the maxima agree bit for bit (tested).

The clip rule (Kimi K2's QK-clip, with the grouped-query rule of ``docs/design.md``): for
head ``h`` with max logit ``S_h`` above the threshold ``tau``, ``gamma_h = tau / S_h``
(else 1); query head ``h`` is scaled by ``gamma_h ** alpha``; key head ``j``, shared by the
query heads ``G_j``, by ``min_{h in G_j} gamma_h ** (1 - alpha)``. A head's logits then
scale by at most ``gamma_h``, so none exceeds ``tau`` on the same inputs; with one query
head per key head (MHA) unclipped heads are untouched.

Rounding: ``S_h`` is measured on activations (and, on CUDA, scores) of finite precision, and
the scaled rows are rounded to the weights' dtype, so a head clipped to exactly ``tau``
lands within a few unit roundoffs of it, on either side (bf16: up to 1.008 ``tau`` against a
float64 recomputation). The clip therefore aims at ``tau * (1 - slack)``
(:func:`rounding_slack`, a small multiple of those unit roundoffs), and clips every head
above that.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "head_gammas",
    "key_factors",
    "max_logits_per_head",
    "query_factors",
    "recording_roundoff",
    "rounding_slack",
    "row_factors",
    "unit_roundoff",
]

# Scores per block: 4 Mi fp32 values, 16 MiB.
DEFAULT_CHUNK_ELEMENTS = 1 << 22


def _key_range(
    rows: range, kv_len: int, offset: int, causal: bool, sliding_window: int | None, masked: bool
) -> range:
    """The keys a block of queries can see by the causal and sliding-window rules (all of
    them when a mask rules instead): a causal block skips the keys after its last query."""
    if masked:
        return range(kv_len)
    stop = min(kv_len, offset + rows.stop) if causal else kv_len
    start = max(0, offset + rows.start - sliding_window + 1) if sliding_window else 0
    return range(start, max(start, stop))


def _valid_positions(
    mask: Tensor | None,
    rows: range,
    keys: range,
    offset: int,
    causal: bool,
    sliding_window: int | None,
    device: torch.device,
) -> Tensor | None:
    """``[len(rows), len(keys)]`` bool (or broadcastable), True where a query may attend.

    ``mask``: this sequence's slice of the attention mask, ``[heads or 1, q, kv]`` bool
    (True: attend) or additive float (masked: very negative); without one, the causal and
    sliding-window rules (queries are the last positions: ``offset = kv_len - q_len``).
    """
    if mask is not None:
        block = mask[..., rows.start : rows.stop, keys.start : keys.stop]
        if block.dtype == torch.bool:
            return block
        return block > torch.finfo(block.dtype).min / 2
    if not causal and sliding_window is None:
        return None
    query_pos = torch.arange(rows.start, rows.stop, device=device)[:, None] + offset
    key_pos = torch.arange(keys.start, keys.stop, device=device)[None, :]
    valid = key_pos <= query_pos if causal else torch.ones_like(key_pos, dtype=torch.bool)
    if sliding_window is not None:
        valid = valid & (key_pos > query_pos - sliding_window)
    return valid


def _score_dtype(query: Tensor) -> torch.dtype:
    """float64 for float64; on CUDA half-precision inputs stay half (tensor-core GEMMs, fp32
    accumulation, scores rounded to 8-11 bits: ~0.4% at most, immaterial to a threshold);
    float32 otherwise."""
    if query.dtype == torch.float64:
        return torch.float64
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    return torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the spacing of ``dtype`` at 1: the largest relative error of one rounding to it
    (bf16 2^-8, fp16 2^-11, fp32 2^-24); 0 for a dtype that is not floating point."""
    return torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0


def recording_roundoff(query: Tensor, key: Tensor) -> float:
    """The unit roundoff of the coarsest of the query, the key, the score dtype
    :func:`max_logits_per_head` computes them in and the autocast dtype in force (rotary
    embeddings upcast autocast's bf16 projections to fp32, which keep bf16's precision):
    what a maximum recorded now carries."""
    dtypes = [query.dtype, key.dtype, _score_dtype(query)]
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtypes.append(torch.get_autocast_dtype(device))
    return max(unit_roundoff(d) for d in dtypes)


# The clip aims this many combined unit roundoffs below tau. Over ~1000 random heads per
# dtype (the models of tests/qk_clip/test_qk_clip_rounding.py), a head clipped to tau exactly
# landed at most ~3 unit roundoffs above it in bf16 and fp16 (a third of the slack, 8 of
# them) and 7.4 in fp32, whose sums round at every step: fp32 gets the floor instead, which
# is 250 of its roundoffs and so also covers sums far longer than a test's.
ROUNDING_SLACK_ROUNDOFFS = 4.0
MIN_ROUNDING_SLACK = 2.0**-16


def rounding_slack(recorded_roundoff: float, weight_roundoff: float) -> float:
    """How far below the threshold the clip aims, relative: ``4 * (u_recorded + u_weight)``
    (bf16 throughout: 1/32), at least 2^-16 (fp32)."""
    return max(MIN_ROUNDING_SLACK, ROUNDING_SLACK_ROUNDOFFS * (recorded_roundoff + weight_roundoff))


def max_logits_per_head(
    query: Tensor,
    key: Tensor,
    scaling: float,
    attention_mask: Tensor | None = None,
    *,
    causal: bool = True,
    sliding_window: int | None = None,
    key_padding: Tensor | None = None,
    segments: Tensor | None = None,
    chunk_heads: int | None = None,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> Tensor:
    """The largest ``scaling * q_i . k_j`` over the batch and every attended pair, per query
    head: ``[heads]`` float32 (float64 for float64 inputs); ``-inf`` for a head that attends
    nowhere.

    ``query``: ``[batch, heads, q_len, head_dim]``; ``key``: ``[batch, kv_heads, kv_len,
    head_dim]`` (``heads`` a multiple of ``kv_heads``: query head ``h`` reads key head
    ``h // (heads // kv_heads)``); ``attention_mask``: ``None`` or ``[batch, 1 or heads,
    q_len, kv_len]`` bool (True: attend) or additive float; without one, causal and
    ``sliding_window`` apply, and flash-style inputs: ``key_padding`` ``[batch, kv_len]``
    (True/1: a real token) and ``segments`` ``[batch, kv_len]`` (packed sequences: the
    document of each position; a query sees keys of its own document only). ``chunk_heads``: the head count
    the block size is computed for (default ``heads``; pass the global count under tensor
    parallel so that every rank blocks alike). Scores are computed in float32 (float64
    inputs in float64; half-precision ones on CUDA in their own dtype).
    """
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(
            f"query and key must be [batch, heads, seq, head_dim]; got {tuple(query.shape)} "
            f"and {tuple(key.shape)}"
        )
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % max(kv_heads, 1):
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} do not pair: same batch "
            "and head_dim, and query heads a multiple of key heads, are needed"
        )
    dtype = _score_dtype(query)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((heads,), -math.inf, dtype=out_dtype, device=query.device)
    if batch == 0 or q_len == 0 or kv_len == 0:
        return out
    group = heads // kv_heads
    per_query = max(chunk_heads or heads, heads) * kv_len  # scores per query position
    block = max(1, chunk_elements // per_query)  # query positions per block
    # Whole short sequences are grouped; a long one is cut into blocks of queries. Either
    # way each (sequence, head) score block has the same shape on every rank.
    seqs = max(1, chunk_elements // (per_query * min(block, q_len)))
    offset = kv_len - q_len
    for b0 in range(0, batch, seqs):
        b1 = min(batch, b0 + seqs)
        keys_t = key[b0:b1].to(dtype).mT  # [n, kv_heads, head_dim, kv_len]
        mask_b = attention_mask[b0:b1] if attention_mask is not None else None
        for start in range(0, q_len, block):
            rows = range(start, min(q_len, start + block))
            keys = _key_range(rows, kv_len, offset, causal, sliding_window, mask_b is not None)
            if not keys:
                continue
            q = query[b0:b1, :, rows.start : rows.stop].to(dtype)  # [n, heads, c, head_dim]
            n, _, c, _ = q.shape
            k = keys_t[..., keys.start : keys.stop]
            scores = torch.matmul(q.reshape(n, kv_heads, group * c, head_dim), k)
            scores = scores.view(n, heads, c, len(keys)).mul_(scaling)
            valid = _valid_positions(
                mask_b, rows, keys, offset, causal, sliding_window, query.device
            )
            if key_padding is not None:
                keep = key_padding[b0:b1, None, None, keys.start : keys.stop].bool()
                valid = keep if valid is None else valid & keep
            if segments is not None:
                seg = segments[b0:b1]
                query_seg = seg[:, None, offset + rows.start : offset + rows.stop, None]
                same = query_seg == seg[:, None, None, keys.start : keys.stop]
                valid = same if valid is None else valid & same
            if valid is not None:
                scores.masked_fill_(~valid, -math.inf)  # broadcast: no [n, heads, c, kv] mask
            out = torch.maximum(out, scores.amax(dim=(0, 2, 3)).to(out_dtype))
    return out


def head_gammas(max_logits: Tensor, threshold: float) -> Tensor:
    """``min(1, threshold / S_h)`` per head (1 for heads at or below the threshold, and for
    heads that saw nothing: ``-inf``)."""
    gammas = torch.ones_like(max_logits, dtype=torch.float64)
    over = max_logits > threshold
    gammas[over] = threshold / max_logits[over].double()
    return gammas


def query_factors(gammas: Tensor, alpha: float) -> Tensor:
    """Each query head's scale, ``gamma_h ** alpha``: ``[heads]`` float64."""
    return gammas.double().pow(alpha)


def key_factors(gammas: Tensor, kv_heads: int, alpha: float) -> Tensor:
    """Each key head's scale, the smallest gamma of the query heads that read it, to the
    ``1 - alpha``: ``[kv_heads]`` float64."""
    heads = gammas.numel()
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} key heads")
    return gammas.double().view(kv_heads, heads // kv_heads).amin(dim=1).pow(1.0 - alpha)


def row_factors(head_factors: Tensor, head_dim: int) -> Tensor:
    """A per-head scale as a per-row scale of a ``[heads * head_dim, ...]`` projection."""
    return head_factors.repeat_interleave(head_dim)
