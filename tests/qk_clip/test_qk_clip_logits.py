"""``max_logits_per_head``, QK-clip's blocked maxima, against the full score matrix in float64
(causal, sliding windows, boolean and additive masks), bitwise across head and batch splits
(tensor- and data-parallel ranks); the factors of the grouped-query rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardmuon.qk_clip.logits import key_factors, max_logits_per_head, query_factors

pytestmark = pytest.mark.usefixtures("no_leftover_clips")


def _naive(query, key, scaling, valid):
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.mT * scaling
    return scores.masked_fill(~valid, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("chunk_elements", [1, 7, 64, 1 << 22])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (3, 1)])
def test_blocked_maxima_equal_the_full_score_matrix(chunk_elements, heads, kv_heads) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 5, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 9, 8, generator=gen, dtype=torch.float64)
    # Causal with a 4-token past (a cache): query i sees keys <= i + 4.
    causal = torch.ones(5, 9, dtype=torch.bool).tril(4)
    got = max_logits_per_head(q, k, 0.3, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, causal))
    window = causal & ~torch.ones(5, 9, dtype=torch.bool).tril(4 - 3)
    got = max_logits_per_head(q, k, 0.3, sliding_window=3, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, window))
    mask = torch.rand(2, 1, 5, 9, generator=gen) > 0.4
    mask[..., 0] = True
    got = max_logits_per_head(q, k, 0.3, mask, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, mask))
    # Hugging Face's additive masks put the dtype's lowest value on masked pairs.
    additive = torch.zeros(2, 1, 5, 9, dtype=torch.float64)
    additive = additive.masked_fill(~mask, torch.finfo(torch.float64).min)
    got = max_logits_per_head(q, k, 0.3, additive, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, mask))
    got = max_logits_per_head(q, k, 0.3, causal=False, chunk_elements=chunk_elements)
    torch.testing.assert_close(got, _naive(q, k, 0.3, torch.ones(5, 9, dtype=torch.bool)))


def test_the_block_depends_on_the_global_head_count_only() -> None:
    """Half the heads (a tensor-parallel rank) with chunk_heads = all heads: bitwise the
    same maxima as the whole computation, for fp32 inputs."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 8, 37, 16, generator=gen)
    k = torch.randn(3, 4, 37, 16, generator=gen)
    whole = max_logits_per_head(q, k, 0.25, chunk_elements=2000)
    halves = [
        max_logits_per_head(
            q[:, 4 * i : 4 * i + 4], k[:, 2 * i : 2 * i + 2], 0.25, chunk_heads=8,
            chunk_elements=2000,
        )
        for i in range(2)
    ]  # fmt: skip
    assert torch.equal(torch.cat(halves), whole)


@pytest.mark.parametrize("seq", [5, 40])
def test_a_batch_split_over_ranks_gives_the_maxima_bitwise(seq) -> None:
    """Five sequences at once or as 2 + 3 (two data-parallel ranks), short sequences grouped
    and long ones cut into query blocks: the same fp32 maxima, bit for bit."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(5, 4, seq, 16, generator=gen)
    k = torch.randn(5, 2, seq, 16, generator=gen)
    whole = max_logits_per_head(q, k, 0.25, chunk_elements=900)
    parts = [
        max_logits_per_head(q[s], k[s], 0.25, chunk_elements=900)
        for s in (slice(0, 2), slice(2, 5))
    ]
    assert torch.equal(torch.maximum(*parts), whole)


def test_factors_of_the_grouped_query_rule() -> None:
    gammas = torch.tensor([1.0, 0.5, 0.8, 1.0, 0.25, 0.9], dtype=torch.float64)
    torch.testing.assert_close(query_factors(gammas, 0.5), gammas.sqrt())
    torch.testing.assert_close(
        key_factors(gammas, 2, 0.5), torch.tensor([0.5, 0.25], dtype=torch.float64).sqrt()
    )
    torch.testing.assert_close(key_factors(gammas, 6, 0.0), gammas)
    torch.testing.assert_close(key_factors(gammas, 3, 1.0), torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="6 query heads do not divide into 4 key heads"):
        key_factors(gammas, 4, 0.5)
