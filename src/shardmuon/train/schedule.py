"""Learning-rate schedule of ``shardmuon train``: linear warmup, then constant or cosine.

The lr of a step is a pure function of the step, so a resumed run sets exactly the lr the
uninterrupted run set (whatever lr the checkpoint's param groups hold is overwritten before
the next step). Each param group's peak is the config's: ``optim.lr``, or ``adamw_lr`` for
Muon's AdamW group (embeddings, norms, the output head) when it is given. A Sinkhorn group
(``embedding_update="sinkhorn"``: the embedding and the head) has Muon's peak, ``optim.lr``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MIN_LR_FRACTION", "SCHEDULES", "lr_factor", "set_learning_rates"]

SCHEDULES = ("constant", "cosine")
# Where the cosine ends, as a fraction of the peak (a schedule that ends at 0 spends its
# last steps learning nothing).
MIN_LR_FRACTION = 0.1


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """The peak lr's multiplier at 1-based ``step``: ``step / warmup_steps`` during the
    warmup, then 1 (``constant``) or a cosine from 1 down to :data:`MIN_LR_FRACTION` at
    ``total_steps`` (``cosine``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} unknown; accepted: {', '.join(SCHEDULES)}")
    if step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def set_learning_rates(optimizer: torch.optim.Optimizer, config, step: int) -> None:
    """Set every param group's lr for 1-based ``step`` of ``config`` (a
    :class:`~shardmuon.train.config.TrainConfig`)."""
    factor = lr_factor(step, config.steps, config.warmup_steps, config.schedule)
    for group in optimizer.param_groups:
        peak = config.optim.lr
        if group.get("algorithm") == "adamw" and config.adamw_lr is not None:
            peak = config.adamw_lr
        group["lr"] = peak * factor
