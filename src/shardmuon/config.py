"""Validated optimizer config (prime-rl's ``optim.*`` fields for Muon) and ``build_optimizer``.

:class:`MuonConfig` is a pydantic v2 model rather than a self-checking dataclass because
the config it mirrors (prime-rl's ``optim.*`` section) is pydantic and arrives as parsed
TOML/JSON/CLI values: pydantic turns ``"0.02"`` or ``[0.9, 0.95]`` into the right types,
``extra="forbid"`` turns a misspelt key (``momentum`` for ``mu``) into an error instead of a
silently ignored setting, and ``model_dump()``/``model_json_schema()`` come for free. The
package already depends on pydantic. The ranges of the numeric settings are
stated once, in :data:`FIELD_RANGES`, and checked by the constructor's own checks
(:mod:`shardmuon.validation`, :func:`shardmuon.qk_clip.check_qk_clip_settings`), run by
validators that raise ``ValueError`` naming the field, the value given and what is accepted;
pydantic wraps it in ``pydantic.ValidationError``, which is itself a ``ValueError`` (so
``except ValueError`` catches every bad config). :func:`config_error` says pydantic's report
in one line; :func:`check_setting` checks one setting alone, through the same validators
(``shardmuon train``'s optimizer flags are checked by it while the arguments are parsed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from torch import Tensor, nn

from shardmuon.ops.newton_schulz import resolve_coefficients
from shardmuon.routing import build_param_groups
from shardmuon.settings import SETTING_NAMES, MuonSettings, NumberRange, setting_field
from shardmuon.validation import EPSILON_MIN, check_adjust_lr, check_number

if TYPE_CHECKING:
    from shardmuon.optimizer import Muon

__all__ = [
    "FIELD_RANGES",
    "QK_CLIP_FIELDS",
    "MuonConfig",
    "NumberRange",
    "build_optimizer",
    "build_qk_clip",
    "check_setting",
    "config_error",
]

# MuonConfig fields that configure QK-clip rather than the optimizer.
QK_CLIP_FIELDS = ("qk_clip_threshold", "qk_clip_alpha")

CoefficientSpec = str | list[tuple[float, float, float]] | None


def _number(field_name: str, value: Any) -> Any:
    """A TOML/CLI value (``"0.02"``) as a float; anything else is left to the range check,
    which names what is accepted (bools are refused there: ``lr=True`` is a typo)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if not isinstance(value, (bool, int, float, Tensor)) and hasattr(value, "__float__"):
        return float(value)  # a numpy scalar, say
    return value


def _checked_number(
    name: str, value: Any, upper: float | None, positive: bool, lower: float = 0.0
) -> float:
    try:
        check_number(name, value, upper, positive=positive, lower=lower)
    except TypeError as err:  # pydantic reports ValueErrors against the field
        raise ValueError(str(err)) from None
    return float(value.item() if hasattr(value, "item") else value)


# The range of every numeric setting, stated once. The validators below check it (lr to
# update_rms through the constructor's validation.check_number, which takes a range from
# ``low`` (0 unless given), > low where low_open, below an excluded upper bound; the QK-clip
# pair through QKClip's own check_qk_clip_settings), and shardmuon train's flags are
# described by it.
FIELD_RANGES: dict[str, NumberRange] = {
    "lr": NumberRange(0.0),
    "weight_decay": NumberRange(0.0),
    # float32's smallest normal number (validation.EPSILON_MIN: below it, 0 / 0 for a zero grad)
    "epsilon": NumberRange(EPSILON_MIN),
    "mu": NumberRange(0.0, 1.0, high_open=True),
    "update_rms": setting_field("update_rms").metadata["range"],
    "qk_clip_threshold": NumberRange(0.0, low_open=True),
    "qk_clip_alpha": NumberRange(0.0, 1.0),
}

# Settings whose own check runs before pydantic's coercion (Accepts.strict).
STRICT_SETTINGS = tuple(
    name for name in SETTING_NAMES if setting_field(name).metadata["accepts"].strict
)


class _MuonConfig(BaseModel):
    """Every ``shardmuon.Muon`` constructor option a user sets, with the same names.

    Defaults are the constructor's, except ``adjust_lr``: the constructor defaults to dion's
    ``"spectral_norm"`` (drop-in for dion call sites), the config to prime-rl's
    ``"rms_norm"`` with ``update_rms=0.2`` (prime-rl's ``optim.*`` defaults). Left out on
    purpose: ``params`` and ``matrix_partitions`` (they come from the model, through
    :func:`build_optimizer`'s routing) and the dion mesh arguments (ignored by ``Muon``).

    ``newton_schulz_coefficients``: a preset name from ``shardmuon.NS_PRESETS``, a list of
    ``(a, b, c)`` triples (one per iteration), or ``None`` for the ``"dion"`` preset.
    A list is stored as a list of float triples; a name is kept as the name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    lr: float = 0.01
    mu: float = 0.95
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    epsilon: float = 1e-8
    adjust_lr: str | None = "rms_norm"
    flatten: bool = False
    # The optimizer-wide settings (MuonSettings' fields) are added below, by create_model.
    # QK-clip (not Muon arguments: build_qk_clip reads them); None = off.
    qk_clip_threshold: float | None = None
    qk_clip_alpha: float = 0.5

    @field_validator("qk_clip_alpha", "qk_clip_threshold", mode="before")
    @classmethod
    def _qk_clip(cls, value: Any, info: ValidationInfo) -> Any:
        from shardmuon.qk_clip import check_qk_clip_settings

        value = _number(info.field_name, value)
        if value is None and info.field_name == "qk_clip_threshold":
            return None
        setting = info.field_name.removeprefix("qk_clip_")
        try:
            check_qk_clip_settings(**{setting: value}, field_prefix="qk_clip_")
        except TypeError as err:  # pydantic reports ValueErrors per field
            raise ValueError(str(err)) from None
        return float(value)

    @field_validator("lr", "weight_decay", "epsilon", "mu", mode="before")
    @classmethod
    def _numbers(cls, value: Any, info: ValidationInfo) -> float:
        name = info.field_name
        limits = FIELD_RANGES[name]
        lower = 0.0 if limits.low is None else limits.low
        return _checked_number(name, _number(name, value), limits.high, limits.low_open, lower)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas(cls, value: Any) -> tuple[float, float]:
        if (
            isinstance(value, (str, bytes))
            or not isinstance(value, (list, tuple))
            or len(value) != 2
        ):
            raise ValueError(
                f"betas must be a pair (beta1, beta2) of numbers in [0, 1), got {value!r}"
            )
        return tuple(
            _checked_number(f"betas[{i}]", _number(f"betas[{i}]", beta), 1.0, False)
            for i, beta in enumerate(value)
        )

    @field_validator("adjust_lr", mode="before")
    @classmethod
    def _adjust_lr(cls, value: Any) -> Any:
        check_adjust_lr("", value)
        return value

    @field_validator("newton_schulz_coefficients", mode="before", check_fields=False)
    @classmethod
    def _coefficients(cls, value: Any) -> Any:
        # resolve_coefficients raises the ValueError/TypeError that names the bad entry;
        # re-raise TypeError as ValueError so pydantic reports it against this field.
        try:
            triples = resolve_coefficients(value)
        except TypeError as err:
            raise ValueError(str(err)) from None
        if value is None or isinstance(value, str):
            return value
        return [tuple(t) for t in triples]

    @field_validator(*STRICT_SETTINGS, mode="before", check_fields=False)
    @classmethod
    def _strict_settings(cls, value: Any, info: ValidationInfo) -> Any:
        # The setting's own check before pydantic's coercion (which would take True as 1).
        name = info.field_name
        if name == "update_rms":  # parsed text and 1-element tensors, as the other numbers
            return _checked_number(name, _number(name, value), None, positive=True)
        try:
            setting_field(name).metadata["accepts"].check(name, value)
        except TypeError as err:  # pydantic reports ValueErrors against the field
            raise ValueError(str(err)) from None
        return value

    @model_validator(mode="after")
    def _settings_together(self) -> _MuonConfig:
        # The constructor's own checks, on the settings as a whole (restarts depend on the
        # schedule's length and the engine).
        try:
            restarts = self.settings().newton_schulz_restarts
        except TypeError as err:
            raise ValueError(str(err)) from None
        object.__setattr__(
            self, "newton_schulz_restarts", None if restarts is None else list(restarts)
        )
        return self

    def settings(self) -> MuonSettings:
        """The optimizer-wide settings this config gives ``Muon``, checked."""
        return MuonSettings(**{name: getattr(self, name) for name in SETTING_NAMES})

    def muon_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``shardmuon.Muon`` (everything but ``params``)."""
        kwargs = self.model_dump(exclude=set(QK_CLIP_FIELDS))
        kwargs["betas"] = tuple(kwargs["betas"])
        return kwargs


def _setting_fields() -> dict[str, Any]:
    """MuonConfig's declaration of each optimizer-wide setting: its config type and default
    (``settings.py`` states both, with the setting)."""
    fields = {}
    for name in SETTING_NAMES:
        spec = setting_field(name)
        fields[name] = (spec.metadata["accepts"].config_type, spec.default)
    return fields


if TYPE_CHECKING:

    class MuonConfig(_MuonConfig):
        """The generated model as a type checker sees it: the settings are its fields."""

        def __getattr__(self, name: str) -> Any: ...

else:
    MuonConfig = create_model(
        "MuonConfig", __base__=_MuonConfig, __module__=__name__, **_setting_fields()
    )
    MuonConfig.__doc__ = _MuonConfig.__doc__


def config_error(err: ValidationError) -> str:
    """pydantic's report on a bad :class:`MuonConfig` in one line: its first error, as the
    validator raised it (which names the field), or as ``field: message`` where the message
    does not name it (pydantic's own errors: an unknown field, a value outside a Literal)."""
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    cause = first.get("ctx", {}).get("error")
    message = str(cause) if isinstance(cause, Exception) else str(first["msg"])
    return message if message.startswith(where) else f"{where}: {message}"


def check_setting(name: str, value: Any) -> Any:
    """``value`` as :class:`MuonConfig` takes it for the setting ``name`` (the other settings
    at their defaults), through the same validators; ``ValueError`` in one line if refused."""
    if name not in MuonConfig.model_fields:
        raise ValueError(f"{name!r} is not a MuonConfig setting")
    try:
        return getattr(MuonConfig(**{name: value}), name)
    except ValidationError as err:
        raise ValueError(config_error(err)) from None


def build_optimizer(
    model: nn.Module,
    config: MuonConfig,
    *,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    expert_mesh_name: str | None = None,
    partition_fused: bool = True,
    embedding_update: str = "adamw",
) -> Muon:
    """Route ``model.named_parameters()`` and build a ``shardmuon.Muon`` over the groups.

    Routing and fused-weight partitions are :func:`shardmuon.routing.build_param_groups`'s;
    the head counts switch on fused-QKV partitions; ``embedding_update="sinkhorn"`` puts the
    embedding tables and output heads in a Sinkhorn group at ``config.lr``. The model may
    already be wrapped (FSDP2 ``fully_shard``, ``torch.compile``, DDP): names keep their
    meaning.
    """
    if not isinstance(config, MuonConfig):
        raise TypeError(f"config must be a MuonConfig, got {type(config).__name__}")
    from shardmuon.optimizer import Muon

    routed = build_param_groups(
        model.named_parameters(),
        lr=config.lr,
        weight_decay=config.weight_decay,
        adjust_lr=config.adjust_lr,
        expert_mesh_name=expert_mesh_name,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        partition_fused=partition_fused,
        embedding_update=embedding_update,
    )
    return Muon(
        params=routed.groups,
        matrix_partitions=routed.partitions or None,
        **config.muon_kwargs(),
    )


def build_qk_clip(model: nn.Module, config: MuonConfig, **options: Any):
    """A :class:`shardmuon.qk_clip.QKClip` over ``model`` with ``config``'s threshold and
    alpha, or ``None`` when ``config.qk_clip_threshold`` is ``None``; ``options`` go to
    ``QKClip`` (``process_group``, ``chunk_elements``). Call it on every rank, after the
    model is laid out, and ``clip.apply()`` after each ``optimizer.step()``."""
    if not isinstance(config, MuonConfig):
        raise TypeError(f"config must be a MuonConfig, got {type(config).__name__}")
    if config.qk_clip_threshold is None:
        return None
    from shardmuon.qk_clip import QKClip

    return QKClip(model, config.qk_clip_threshold, config.qk_clip_alpha, **options)
