"""The optimizers ``shardmuon bench step`` compares, built from the same routed param groups.

Every Muon-like implementation takes the groups of :func:`shardmuon.routing.build_param_groups`
with ``lr``, ``nesterov=True``, ``weight_decay=0.1`` and lr scaling ``rms_norm``;
``adamw`` is the cost yardstick. ``dion`` is dion's Muon (the samsja/dion or microsoft/dion
package, whichever is installed as ``dion``): used only when it can be imported, never a
dependency.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardmuon.harness.models import attention_dims

__all__ = [
    "DEFAULT_OFF",
    "IMPLEMENTATIONS",
    "OFFLOAD_SUFFIX",
    "OVERLAP_SUFFIX",
    "dion_unavailable",
    "make_optimizer",
    "shardmuon_options",
]

IMPLEMENTATIONS: tuple[str, ...] = (
    "shardmuon",
    "shardmuon-unfolded",
    "shardmuon-compiled",
    "shardmuon-no-rotation",
    "shardmuon-split-replicas",
    "shardmuon-check-always",
    "shardmuon-gram",
    "dion",
    "torch-muon",
    "adamw",
)
# shardmuon.Muon keyword arguments of each shardmuon variant.
SHARDMUON_OPTIONS: dict[str, dict[str, Any]] = {
    "shardmuon": {},
    "shardmuon-unfolded": {"newton_schulz_impl": "unfolded"},
    "shardmuon-compiled": {"newton_schulz_impl": "compiled"},
    "shardmuon-no-rotation": {"rotate_owners": False},
    "shardmuon-split-replicas": {"split_replicas": True},
    "shardmuon-check-always": {"check_grads": "always"},
    "shardmuon-gram": {"newton_schulz_impl": "gram"},
}
# Run only when asked for (--impl), with why.
DEFAULT_OFF: dict[str, str] = {
    "shardmuon-compiled": "opt-in (--impl shardmuon-compiled): torch.compile compiles every "
    "Newton-Schulz shape on first use (about 20 s each on a small CPU)",
    "shardmuon-check-always": "opt-in (--impl shardmuon-check-always): the agreement check "
    "on every step, the price of catching a grad that disappears on some ranks after step 1",
    "shardmuon-gram": "opt-in (--impl shardmuon-gram): the Gram Newton-Schulz iteration with "
    "its divergence guard",
}
WEIGHT_DECAY = 0.1
# A shardmuon impl with this suffix runs with ``offload="state"`` (``--offload``), with
# this one ``overlap="forward"`` (``--overlap``), with these ``cuda_graphs=True`` and
# ``False`` (``--cuda-graphs``; the plain row has the default, the guarded calls only);
# several: ``IMPL+offload+overlap``.
OFFLOAD_SUFFIX = "+offload"
OVERLAP_SUFFIX = "+overlap"
GRAPHS_SUFFIX = "+graphs"
EAGER_SUFFIX = "+eager"
_SUFFIX_OPTIONS = {
    OFFLOAD_SUFFIX: {"offload": "state"},
    OVERLAP_SUFFIX: {"overlap": "forward"},
    GRAPHS_SUFFIX: {"cuda_graphs": True},
    EAGER_SUFFIX: {"cuda_graphs": False},
}


def shardmuon_options(impl: str) -> dict[str, Any] | None:
    """``shardmuon.Muon`` keyword arguments of ``impl``, or ``None`` if it is not shardmuon."""
    base, *suffixes = impl.split("+")
    if base not in SHARDMUON_OPTIONS or any(f"+{s}" not in _SUFFIX_OPTIONS for s in suffixes):
        return None
    options = dict(SHARDMUON_OPTIONS[base])
    for suffix in suffixes:
        options.update(_SUFFIX_OPTIONS[f"+{suffix}"])
    return options


def dion_unavailable() -> str | None:
    """Why dion's Muon cannot be run here (``None`` when ``from dion import Muon`` works)."""
    try:
        from dion import Muon  # noqa: F401
    except ImportError as err:
        return f"the dion package is not installed ({err})"
    return None


def make_optimizer(
    impl: str,
    model: nn.Module,
    *,
    model_name: str,
    lr: float,
    coefficients: str,
    expert_mesh_name: str | None,
    meshes: dict[str, Any],
    shardmuon_overrides: dict[str, Any] | None = None,
):
    """Implementation ``impl`` (one of :data:`IMPLEMENTATIONS`) over ``model``'s params.

    ``shardmuon_overrides``: ``MuonConfig`` fields set on top of a shardmuon impl's own
    (``bench step --ns-impl/--ns-dtype``); the other implementations ignore them.

    ``meshes``: the meshes the layout built, by name (:class:`shardmuon.harness.parallel.AppliedLayout`);
    only ``dion`` reads them.
    """
    from shardmuon.config import MuonConfig, build_optimizer
    from shardmuon.routing import build_param_groups

    if impl == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY)
    dims = attention_dims(model_name)
    options = shardmuon_options(impl)
    if options is not None:
        config = MuonConfig(
            lr=lr,
            nesterov=True,
            weight_decay=WEIGHT_DECAY,
            newton_schulz_coefficients=coefficients,
            **{**options, **(shardmuon_overrides or {})},
        )
        return build_optimizer(model, config, expert_mesh_name=expert_mesh_name, **dims)
    routed = build_param_groups(
        model.named_parameters(),
        lr=lr,
        weight_decay=WEIGHT_DECAY,
        expert_mesh_name=expert_mesh_name,
        **dims,
    )
    if impl == "torch-muon":
        return TorchMuonPair(routed.groups, lr)
    return make_dion(routed.groups, lr, fsdp_mesh(meshes))


def fsdp_mesh(meshes: dict[str, Any]):
    """The 1-D mesh params are sharded over (HSDP: its shard dim), ``None`` without one."""
    mesh = meshes.get("dp")
    if mesh is None or mesh.ndim == 1:
        return mesh
    return mesh["dp_shard"]


def make_dion(groups: list[dict], lr: float, mesh):
    """dion's ``Muon`` over ``groups`` (their ``algorithm`` keys say muon or adamw).

    Its settings match shardmuon's runs: Nesterov, weight decay 0.1, ``rms_norm`` lr
    scaling. It takes no fused-weight partitions (it never splits a matrix) and uses its
    own Newton-Schulz coefficients.
    """
    from dion import Muon as DionMuon

    return DionMuon(
        [dict(g) for g in groups],
        distributed_mesh=mesh,
        lr=lr,
        nesterov=True,
        weight_decay=WEIGHT_DECAY,
        adjust_lr="rms_norm",
    )


class TorchMuonPair:
    """``torch.optim.Muon`` on the 2-D Muon params, ``torch.optim.AdamW`` on the rest.

    torch's Muon takes 2-D params only, so 3-D expert stacks go to AdamW here.
    """

    def __init__(self, groups: list[dict], lr: float) -> None:
        muon_params, other = [], []
        for group in groups:
            for p in group["params"]:
                is_matrix = group["algorithm"] == "muon" and p.dim() == 2
                (muon_params if is_matrix else other).append(p)
        self.muon = torch.optim.Muon(
            muon_params,
            lr=lr,
            weight_decay=WEIGHT_DECAY,
            nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        )
        self.adamw = torch.optim.AdamW(other, lr=lr, weight_decay=WEIGHT_DECAY)

    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}
