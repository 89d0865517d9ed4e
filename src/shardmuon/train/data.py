"""Synthetic reverse-text SFT task: random lowercase strings, target = the reversed string.

Every batch is a pure function of ``(seed, step)``, so the data-loader position is just the step
number: a resumed run (at any world size) sees exactly the batches the uninterrupted run saw.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


class CharTokenizer:
    """A tiny character tokenizer: 4 special tokens followed by ``a``-``z``."""

    PAD, BOS, SEP, EOS = 0, 1, 2, 3
    _SPECIALS = ("<pad>", "<bos>", "<sep>", "<eos>")

    def __init__(self, alphabet: str = string.ascii_lowercase) -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise ValueError(f"alphabet must be non-empty with unique characters, got {alphabet!r}")
        self.alphabet = alphabet
        self._char_to_id = {c: i + len(self._SPECIALS) for i, c in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids (specials + alphabet)."""
        return len(self._SPECIALS) + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Character ids of ``text`` (no special tokens)."""
        unknown = sorted({c for c in text if c not in self._char_to_id})
        if unknown:
            raise ValueError(f"characters {unknown} are not in the alphabet {self.alphabet!r}")
        return [self._char_to_id[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        offset = len(self._SPECIALS)
        return "".join(self.alphabet[i - offset] for i in ids if i >= offset)


@dataclass(frozen=True)
class ReverseTextTask:
    """Random strings of length ``min_len..max_len``; each sample is
    ``<bos> s <sep> reversed(s) <eos>`` padded to ``seq_len = 2*max_len + 3``."""

    min_len: int = 4
    max_len: int = 12
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(
                f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}"
            )

    @property
    def seq_len(self) -> int:
        """Length of every padded sample."""
        return 2 * self.max_len + 3

    def batch(
        self, step: int, batch_size: int, tokenizer: CharTokenizer
    ) -> dict[str, torch.Tensor]:
        """The global batch for 1-based ``step``.

        Returns ``input_ids`` and ``labels`` (int64 ``[batch_size, seq_len]``). ``labels`` is
        ``IGNORE_INDEX`` except on the target (reversed string + ``<eos>``); it is aligned with
        ``input_ids`` (token t is predicted from positions < t), the usual causal-LM convention.
        """
        if step < 1:
            raise ValueError(f"step is 1-based, got {step}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        # One generator per (seed, step): the batch does not depend on what ran before it.
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        lengths = torch.randint(self.min_len, self.max_len + 1, (batch_size,), generator=gen)
        input_ids = torch.full((batch_size, self.seq_len), tokenizer.PAD, dtype=torch.long)
        labels = torch.full((batch_size, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        first_char = len(CharTokenizer._SPECIALS)
        for row, length in enumerate(lengths.tolist()):
            chars = torch.randint(0, len(tokenizer.alphabet), (length,), generator=gen) + first_char
            target = torch.cat([chars.flip(0), torch.tensor([tokenizer.EOS])])
            sample = torch.cat(
                [torch.tensor([tokenizer.BOS]), chars, torch.tensor([tokenizer.SEP])]
            )
            sample = torch.cat([sample, target])
            input_ids[row, : sample.numel()] = sample
            labels[row, length + 2 : sample.numel()] = target
        return {"input_ids": input_ids, "labels": labels}


def rank_slice(
    batch: dict[str, torch.Tensor], rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rows of ``batch`` that ``rank`` trains on (contiguous, possibly uneven split)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return {k: v.tensor_split(world_size, dim=0)[rank] for k, v in batch.items()}


def num_target_tokens(labels: torch.Tensor) -> int:
    """Number of supervised tokens in ``labels`` (what the loss is averaged over)."""
    return int((labels != IGNORE_INDEX).sum())
