"""The training tasks behind ``shardmuon train --task``: each gives the global batch of a
step (a pure function of ``(seed, step)``, so that the data position is the step number at
every world size) and, for the language model, a fixed held-out batch.

* ``reverse``: :class:`~shardmuon.train.data.ReverseTextTask` (SFT: the loss is on the
  reversed string only).
* ``lm``: byte-level causal LM pretraining on :mod:`~shardmuon.train.lm_data`'s corpus (the
  loss is on every next byte).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardmuon.train.data import CharTokenizer, ReverseTextTask
from shardmuon.train.lm_data import VOCAB_SIZE, Corpus, CorpusPlan, plan_corpus, read_corpus

__all__ = [
    "TASKS",
    "LanguageModelTask",
    "build_task",
    "check_corpus",
    "task_vocab_size",
]

TASKS = ("reverse", "lm")


@dataclass(frozen=True)
class ReverseTask:
    """The reverse-text SFT task with its character tokenizer."""

    data: ReverseTextTask
    tokenizer: CharTokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The global batch of 1-based ``step``."""
        return self.data.batch(step, batch_size, self.tokenizer)

    def held_out_batch(self) -> None:
        """No held-out set (the training loss is already on fresh samples)."""
        return None


@dataclass(frozen=True)
class LanguageModelTask:
    """Windows of ``seq_len`` bytes: at random offsets of the training text per step, at
    evenly spaced offsets of the held-out text for the held-out batch."""

    corpus: Corpus
    seq_len: int
    seed: int
    eval_sequences: int

    vocab_size = VOCAB_SIZE

    def _windows(self, stream: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
        ids = stream[offsets[:, None] + torch.arange(self.seq_len)].long()
        # Labels aligned with the inputs (token t is predicted from positions < t), as the
        # SFT task's: every byte after the first is a target.
        return {"input_ids": ids, "labels": ids.clone()}

    def batch(self, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The global batch of 1-based ``step``: ``batch_size`` training windows."""
        if step < 1:
            raise ValueError(f"step is 1-based, got {step}")
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        last = self.corpus.train.numel() - self.seq_len
        return self._windows(
            self.corpus.train, torch.randint(0, last + 1, (batch_size,), generator=gen)
        )

    def held_out_batch(self) -> dict[str, torch.Tensor]:
        """The fixed held-out windows (the same at every evaluation and every seed)."""
        last = self.corpus.held_out.numel() - self.seq_len
        offsets = torch.linspace(0, last, self.eval_sequences, dtype=torch.float64).long()
        return self._windows(self.corpus.held_out, offsets)


def check_corpus(plan: CorpusPlan, batch_size: int, seq_len: int) -> None:
    """Refuse (one line naming the path) a corpus smaller than one batch, or whose held-out
    text is shorter than one sequence."""
    train, held_out = plan.tokens(plan.train), plan.tokens(plan.held_out)
    if train < batch_size * seq_len:
        raise ValueError(
            f"data {plan.root!r}: its training text is {train} tokens, fewer than one batch "
            f"(batch_size {batch_size} x seq_len {seq_len} = {batch_size * seq_len}); give "
            "more text or a smaller batch or sequence"
        )
    if held_out < seq_len:
        raise ValueError(
            f"data {plan.root!r}: its held-out text is {held_out} tokens, shorter than one "
            f"sequence (seq_len {seq_len}); give more text or a shorter sequence"
        )


def task_vocab_size(task: str) -> int:
    """The vocabulary of ``task`` (what the model's embedding is built for)."""
    return CharTokenizer().vocab_size if task == "reverse" else VOCAB_SIZE


def build_task(config) -> ReverseTask | LanguageModelTask:
    """The task ``config`` (a :class:`~shardmuon.train.config.TrainConfig`) trains on."""
    if config.task == "reverse":
        data = ReverseTextTask(config.min_len, config.max_len, config.seed)
        return ReverseTask(data, CharTokenizer())
    plan = plan_corpus(config.data, config.data_bytes)
    check_corpus(plan, config.batch_size, config.seq_len)
    return LanguageModelTask(read_corpus(plan), config.seq_len, config.seed, config.eval_sequences)
