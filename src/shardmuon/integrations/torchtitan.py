"""Muon inside torchtitan's trainer (torchtitan 0.3.0).

torchtitan builds its optimizers from ``Trainer.Config.optimizer`` with
``config.optimizer.build(model_parts=...)``, after the model is parallelized (FSDP2, tensor
and expert parallel), so the optimizer sees the DTensors it will step. That ``build`` makes
the class the config is nested in, and torchtitan's own container knows only ``Adam``,
``AdamW`` and ``DistMuon``: :class:`MuonOptimizers` is a container whose ``Config`` builds
itself and which knows ``"shardmuon"``. :func:`with_muon` swaps it into a config from
torchtitan's registry::

    # my_configs.py
    from torchtitan.models.qwen3.config_registry import qwen3_30b_a3b

    from shardmuon.integrations.torchtitan import with_muon


    def qwen3_30b_a3b_muon():
        return with_muon(qwen3_30b_a3b(), lr=0.02, weight_decay=0.1)

and ``torchrun ... -m torchtitan.train --module my_configs --config qwen3_30b_a3b_muon``.

Parameters are routed by their names in torchtitan's models (:data:`ADAMW_PATTERN`, first
match wins as torchtitan's ``ParamGroupConfig``s do): token embeddings, the output head,
norms and biases to AdamW; every other parameter (attention and MLP matrices, the router's
gate, the expert stacks ``w1_EFD``/``w2_EDF``/``w3_EFD``) to Muon. GPT-OSS's attention
sinks and expert bias stacks (``mlp1_bias_EG``) go to AdamW here; ``build_param_groups``
keeps prime-rl's routing of 2-D bias stacks to Muon.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from shardmuon.optimizer import Muon

__all__ = ["ADAMW_PATTERN", "MuonOptimizers", "muon_param_groups", "with_muon"]

# The container's name for shardmuon's factory.
FACTORY_NAME = "shardmuon"

# torchtitan's names for what Muon should not take (searched, so ``_orig_mod.`` and
# activation-checkpoint wrappers in a name do not matter): the token embedding, the output
# head (``lm_head``, ``output`` in older torchtitan), norms (``norm``, ``attention_norm``,
# ``q_norm``...), biases (``.bias``, GPT-OSS's expert stacks ``mlp1_bias_EG``) and GPT-OSS's
# attention ``sinks``.
ADAMW_PATTERN = (
    r"(?:^|\.)(?:tok_embeddings|lm_head|output)\.|norm\.weight$|\.bias$|_bias_[A-Z]+$|\.sinks$"
)


class MuonOptimizers(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds :class:`~shardmuon.Muon` for
    the optimizer name ``"shardmuon"`` (one Muon per model part, its groups from the
    ``ParamGroupConfig``s naming it, ``optimizer_factory_kwargs_by_name["shardmuon"]`` its
    optimizer-wide settings). Its ``Config`` is its own, so that torchtitan's
    ``config.optimizer.build(model_parts=...)`` builds this class."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        # Muon's AdamW groups run their own foreach passes; torchtitan's default ("fused")
        # would put ``fused=True`` into every group, which Muon does not read.
        implementation: str = "for-loop"

    def __init__(self, config: Any, *, model_parts: list) -> None:
        super().__init__(config, model_parts=model_parts)
        # overlap="forward" needs the model's forward to wait for the update of each unit
        # (torchtitan's loop calls no overlap_with): hook each Muon to the parts it steps.
        for optimizer in self.optimizers:
            if isinstance(optimizer, Muon) and optimizer.overlap is not None:
                mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
                for part in model_parts:
                    if any(id(p) in mine for p in part.parameters()):
                        optimizer.overlap_with(part)

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Any:
        if name == FACTORY_NAME:
            return Muon
        return OptimizersContainer._resolve_optimizer_factory(name)


def muon_param_groups(
    *,
    muon: dict[str, Any],
    adamw: dict[str, Any],
    adamw_pattern: str = ADAMW_PATTERN,
) -> list[ParamGroupConfig]:
    """Two ``ParamGroupConfig``s for :class:`MuonOptimizers`: ``adamw_pattern`` with
    ``adamw``'s keywords (``algorithm="adamw"``), then every other parameter with ``muon``'s
    (``algorithm="muon"``). Both go to shardmuon's one optimizer per model part."""
    return [
        ParamGroupConfig(
            pattern=adamw_pattern,
            optimizer_name=FACTORY_NAME,
            optimizer_kwargs={**adamw, "algorithm": "adamw"},
        ),
        ParamGroupConfig(
            pattern=r".*",
            optimizer_name=FACTORY_NAME,
            optimizer_kwargs={**muon, "algorithm": "muon"},
        ),
    ]


def _configured_adamw(config: Any) -> dict[str, Any]:
    """The AdamW settings of ``config``'s optimizer, in shardmuon's names: lr, betas
    (``beta1``, ``beta2``) and eps (``epsilon``) of torchtitan's last (catch-all) AdamW group,
    or of the AdamW group of a config :func:`with_muon` already converted."""
    groups = getattr(getattr(config, "optimizer", None), "param_groups", None) or []
    ours = [
        g.optimizer_kwargs
        for g in groups
        if g.optimizer_name == FACTORY_NAME and g.optimizer_kwargs.get("algorithm") == "adamw"
    ]
    if ours:
        return {k: ours[-1][k] for k in ("lr", "beta1", "beta2", "epsilon") if k in ours[-1]}
    adamw = [g.optimizer_kwargs for g in groups if g.optimizer_name in ("AdamW", "Adam")]
    if not adamw:
        return {}
    kwargs, settings = adamw[-1], {}
    if "lr" in kwargs:
        settings["lr"] = kwargs["lr"]
    if "betas" in kwargs:
        settings["beta1"], settings["beta2"] = (float(b) for b in kwargs["betas"])
    if "eps" in kwargs:
        settings["epsilon"] = kwargs["eps"]
    return settings


def with_muon(
    config: Any,
    *,
    lr: float = 0.02,
    weight_decay: float = 0.1,
    adamw_lr: float | None = None,
    adamw_weight_decay: float = 0.0,
    adamw_pattern: str = ADAMW_PATTERN,
    **muon_settings: Any,
) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) with its optimizer replaced by
    :class:`MuonOptimizers`: matrices and expert stacks on Muon at ``lr``/``weight_decay``;
    embeddings, head, norms and biases on AdamW at ``adamw_lr`` (default: the lr, betas
    and eps of the AdamW ``config`` had, as ``beta1``/``beta2``/``epsilon``, else 3e-4) with
    ``adamw_weight_decay``. Applied to a config it already converted, it keeps that
    config's AdamW settings. ``overlap="forward"`` hooks each model part when the trainer
    builds the optimizers.
    ``muon_settings`` are :class:`~shardmuon.Muon`'s optimizer-wide keywords
    (``adjust_lr``, ``max_in_flight``, ``overlap``...). The learning-rate scheduler,
    checkpointing and everything else in ``config`` stay as they were."""
    adamw = {"lr": 3e-4, **_configured_adamw(config), "weight_decay": adamw_weight_decay}
    if adamw_lr is not None:
        adamw["lr"] = adamw_lr
    config.optimizer = MuonOptimizers.Config(
        param_groups=muon_param_groups(
            muon={"lr": lr, "weight_decay": weight_decay},
            adamw=adamw,
            adamw_pattern=adamw_pattern,
        ),
        optimizer_factory_kwargs_by_name={FACTORY_NAME: dict(muon_settings)},
    )
    return config
