"""MuP (maximal update parameterization) overrides: per-group lr and Adam eps scaled by model width.

A port of Megatron-Core's ``get_mup_config_overrides`` (``megatron/core/optimizer/__init__.py``,
NVIDIA/Megatron-LM at commit 0044db1f20bf9311d6cfc77e76fa05163e97ce44), written with
optzoo's registered predicates and ``ParamKey.exclude`` instead of closures, so the keys it
returns compare equal across calls and can be written to a recipe.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from optzoo.config import OptimizerConfig
from optzoo.optimizers.registry import get_spec, registered_names
from optzoo.routing import ParamKey, ParamPredicate, ParamWithNamePredicate, get_predicate

__all__ = ["get_mup_config_overrides"]


def _with_name(name: str) -> ParamWithNamePredicate:
    predicate = get_predicate(name)
    assert isinstance(predicate, ParamWithNamePredicate)  # the built-in's kind is fixed
    return predicate


def _plain(name: str) -> ParamPredicate:
    predicate = get_predicate(name)
    assert isinstance(predicate, ParamPredicate)  # the built-in's kind is fixed
    return predicate


_DECOUPLED_ROLES = ("embedding", "output")
"""The roles the standard overrides give ``decoupled_lr`` besides Megatron's tag: MuP's rules leave
them out, as they leave the tag out, so the two never set one param's lr differently."""


def get_mup_config_overrides(
    config: OptimizerConfig, mup_width_mult: float, optimizer_type: str | None = None
) -> dict[ParamKey, dict[str, Any]]:
    r"""MuP's per-parameter lr (and Adam eps) scaling, as ``{ParamKey: override}``.

    With :math:`m` = ``mup_width_mult`` (the model's hidden size over the base model's, on
    which the hyperparameters were tuned), following Megatron-Core:

    * a parameter is **vector-like** when it is 0-D or 1-D, or an embedding: attribute
      ``shared_embedding`` truthy, else attribute ``is_embedding_parameter`` when present, else
      ``"embedding"`` in its lower-cased name (predicate ``is_mup_vector_like``); every other
      parameter is **hidden** (matrix-like), the output layer included;
    The rules follow the optimizer's family in its registry record (``OptimizerSpec.family``):

    * **Adam family** (``adam``): hidden params get ``max_lr = lr / m`` (``lr * (1 / m)``, Megatron's
      arithmetic), ``min_lr = min_lr / m`` when ``config.min_lr`` is set, and
      ``adam_eps = adam_eps / m``; vector-like params keep the base values;
    * **SGD family** (``sgd``): vector-like params get ``max_lr = lr * m`` (and ``min_lr * m``);
      hidden params keep the base lr; no eps change;
    * **any other family** (``lion``, ``soap``, ``muon``, ``adaptive_muon``): hidden params
      get the lr and min_lr above, no eps change; for the ``orthogonalized`` family (``muon``,
      ``adaptive_muon``) the matrices Muon manages itself (predicate ``is_muon_matrix``: 2-D, not tagged
      ``is_embedding_or_output_parameter``, ``use_muon`` not False) are left out, since Muon
      already scales its update by the matrix shape (``muon_scale_mode``);
    * with ``config.decoupled_lr`` set, parameters tagged ``is_embedding_or_output_parameter``
      keep the decoupled lr (no lr override from MuP, so no conflict with the standard
      overrides); under Adam they still get the eps scaling when hidden (the output layer);
    * ``mup_width_mult == 1`` returns ``{}``.

    Merge the result with the standard overrides (``{**get_standard_config_overrides(config),
    **mup}``) or your own: the keys set ``max_lr``, ``min_lr`` and ``adam_eps`` only.

    Deviations from Megatron-Core: ``optimizer_type`` defaults to ``config.optimizer`` (Megatron:
    ``'adam'`` whatever the config says) and must be a registered optimizer; the eps override
    is the config field ``adam_eps`` (Megatron writes the torch group key ``eps``); the
    "muon-managed" test also honours ``use_muon=False``, as optzoo's Muon routing does; the
    warnings (``UserWarning``, not a log line) are given only when ``mup_width_mult != 1``.
    Megatron's later releases deprecate this function in favour of
    ``OptimizerConfig.overrides_config``; its rules are unchanged.

    Args:
        config: The base config: ``lr``, ``min_lr``, ``adam_eps`` and ``decoupled_lr`` are read.
        mup_width_mult: :math:`m > 0`, ``hidden_size / base_hidden_size``.
        optimizer_type: The optimizer whose rules apply (default ``config.optimizer``). Pass
            ``"muon"`` when your rules send the hidden matrices to Muon from an Adam config, as
            the ``muon-llm`` recipe does.

    Returns:
        At most two keys: for Adam without ``decoupled_lr`` one key (lr and eps together), with
        it one for the lr and one for the eps; for SGD one key; none when ``m == 1`` (or when
        ``lr``/``min_lr`` are unset and there is nothing to scale).

    Raises:
        ValueError: ``mup_width_mult`` is not a finite number > 0, or ``optimizer_type`` is not
            a registered optimizer.

    Warns:
        UserWarning: ``decoupled_lr`` is set (MuP leaves the embedding/output lr alone), or a
            Muon-family optimizer runs with ``muon_scale_mode='spectral'`` or ``'match_rms_adamw'`` (its matrices keep
            spectral scaling; ``unit_rms_norm`` is the MuP-consistent mode).

    Example:
        >>> config = OptimizerConfig(lr=1e-3, adam_eps=1e-8)
        >>> [(key.describe(), value) for key, value in get_mup_config_overrides(config, 4.0).items()]
        [("name='*', exclude=(with_name_predicate='is_mup_vector_like')", {'max_lr': 0.00025, 'adam_eps': 2.5e-09})]
    """
    if isinstance(mup_width_mult, bool) or not isinstance(mup_width_mult, (int, float)) or not (
        math.isfinite(mup_width_mult) and mup_width_mult > 0
    ):
        raise ValueError(
            f"`mup_width_mult`: must be a finite number > 0; got {mup_width_mult!r}; "
            "expected hidden_size / base_hidden_size, e.g. 4.0"
        )
    optimizer = config.optimizer if optimizer_type is None else optimizer_type
    if optimizer not in registered_names():
        raise ValueError(
            f"`optimizer_type`: unknown optimizer; got {optimizer!r}; expected one of {registered_names()}"
        )
    if mup_width_mult == 1.0:
        return {}
    family = get_spec(optimizer).family
    is_sgd, is_adam, is_muon = family == "sgd", family == "adam", family == "orthogonalized"
    decoupled = config.decoupled_lr is not None
    if decoupled:
        warnings.warn(
            f"`get_mup_config_overrides`: decoupled_lr sets an absolute lr for the embedding and output "
            f"params, which MuP leaves alone; got decoupled_lr={config.decoupled_lr!r}; expected nothing else"
            + ("; Adam eps scaling still applies to the hidden params, the output layer included" if is_adam else ""),
            UserWarning,
            stacklevel=2,
        )
    if is_muon and config.muon_scale_mode in ("spectral", "match_rms_adamw"):
        warnings.warn(
            "`get_mup_config_overrides`: Muon-managed matrices keep Muon's own shape scaling, not MuP's; got "
            f"muon_scale_mode={config.muon_scale_mode!r}; expected muon_scale_mode='unit_rms_norm' for MuP-consistent Muon updates",
            UserWarning,
            stacklevel=2,
        )

    vector_like = _with_name("is_mup_vector_like")
    tagged = "is_embedding_or_output_parameter"
    overrides: dict[ParamKey, dict[str, Any]] = {}
    if is_sgd:
        scaled = _scaled(config, mup_width_mult)
        if scaled:
            exclude = ParamKey(attr=tagged, role=_DECOUPLED_ROLES) if decoupled else None
            overrides[ParamKey(with_name_predicate=vector_like, exclude=exclude)] = scaled
        return overrides

    # Hidden = everything that is not vector-like (nor, for Muon, a matrix Muon manages).
    muon_matrix: ParamPredicate | tuple[ParamPredicate, ...] = _plain("is_muon_matrix") if is_muon else ()
    hidden = ParamKey(name="*", exclude=ParamKey(predicate=muon_matrix, with_name_predicate=vector_like))
    lr = _scaled(config, 1.0 / mup_width_mult)
    # MuP Appendix B.3 (as Megatron): eps scales like the update, 1/width, in sqrt(v) + eps.
    eps = {"adam_eps": config.adam_eps * (1.0 / mup_width_mult)} if is_adam else {}
    if not decoupled:
        if lr or eps:
            overrides[hidden] = {**lr, **eps}
        return overrides
    if lr:
        not_tagged = ParamKey(
            name="*", exclude=ParamKey(attr=tagged, predicate=muon_matrix, with_name_predicate=vector_like, role=_DECOUPLED_ROLES)
        )
        overrides[not_tagged] = lr
    if eps:
        overrides[hidden] = eps
    return overrides


def _scaled(config: OptimizerConfig, factor: float) -> dict[str, Any]:
    """``max_lr`` and ``min_lr`` of ``config`` times ``factor``, for those that are set."""
    scaled: dict[str, Any] = {}
    if config.lr is not None:
        scaled["max_lr"] = config.lr * factor
    if config.min_lr is not None:
        scaled["min_lr"] = config.min_lr * factor
    return scaled
