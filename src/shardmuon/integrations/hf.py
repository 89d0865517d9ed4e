"""Muon for Hugging Face ``transformers.Trainer``.

``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))`` treats a ``cls`` that is not an optimizer
class as a factory: it calls ``cls()(model, **kwargs)`` once the model is wrapped (FSDP2
through ``accelerate``, DDP), so the optimizer sees the parameters it will step.
:class:`MuonFactory` is one::

    from shardmuon.integrations.hf import MuonFactory

    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        optimizer_cls_and_kwargs=(MuonFactory, {"lr": 0.02, "weight_decay": 0.1}),
    )

It routes the model as :func:`shardmuon.routing.build_param_groups` does (matrices to
Muon; embeddings and heads, found by what they are, and vectors to AdamW) and, as the Trainer
does for its own optimizers, decays no vector (biases, norms). ``optimizer_cls_and_kwargs=
(shardmuon.Muon, kwargs)`` works too, splitting the Trainer's groups by shape only
(embeddings and heads are then matrices).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from shardmuon.optimizer import Muon
from shardmuon.routing import build_param_groups

__all__ = ["MuonFactory"]


class MuonFactory:
    """``transformers.Trainer``'s optimizer-factory protocol: ``MuonFactory()(model,
    **kwargs)`` returns a :class:`~shardmuon.Muon` over ``model``'s trainable parameters.

    ``lr``, ``weight_decay``, ``adjust_lr``, ``embedding_update``: as in
    :func:`~shardmuon.routing.build_param_groups` (``matrix_partitions`` given here are
    added to the fused weights it recognises); ``decay_vectors=False`` (default, the
    Trainer's convention): AdamW's 0-D/1-D parameters get no weight decay. Every other
    keyword goes to :class:`~shardmuon.Muon`. The routing is kept as the optimizer's
    ``routing`` attribute (``opt.routing.summary()``).
    """

    def __call__(
        self,
        model: nn.Module,
        *,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        embedding_update: str = "adamw",
        adjust_lr: str | None = "rms_norm",
        decay_vectors: bool = False,
        matrix_partitions: dict | None = None,
        **kwargs: Any,
    ) -> Muon:
        if not isinstance(model, nn.Module):
            raise TypeError(f"MuonFactory needs the model (an nn.Module), got {model!r}")
        routed = build_param_groups(
            model,
            lr=lr,
            weight_decay=weight_decay,
            adjust_lr=adjust_lr,
            embedding_update=embedding_update,
        )
        groups = []
        for group in routed.groups:
            if group["algorithm"] != "adamw" or decay_vectors:
                groups.append(group)
                continue
            matrices = [p for p in group["params"] if p.ndim >= 2]
            vectors = [p for p in group["params"] if p.ndim < 2]
            if matrices:
                groups.append({**group, "params": matrices})
            if vectors:
                groups.append({**group, "params": vectors, "weight_decay": 0.0})
        optimizer = Muon(
            groups,
            lr=lr,
            weight_decay=weight_decay,
            adjust_lr=adjust_lr,
            matrix_partitions={**routed.partitions, **(matrix_partitions or {})},
            **kwargs,
        )
        optimizer.routing = routed
        if optimizer.overlap is not None:
            # The Trainer calls no overlap_with: its forward must wait for each unit's update.
            optimizer.overlap_with(model)
        return optimizer
