"""The standard overrides Megatron-Core applies when ``config_overrides`` is ``None``."""

from __future__ import annotations

from typing import Any

from .keys import ParamKey, ParamPredicate, ParamWithNamePredicate
from .predicates import get_predicate

__all__ = ["standard_overrides"]


def standard_overrides(
    *,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    apply_wd_to_qk_layernorm: bool = False,
) -> dict[ParamKey, dict[str, Any]]:
    """No weight decay on biases and 1-D parameters; optionally a decoupled embedding/output lr.

    Mirrors Megatron-Core's ``get_standard_config_overrides``: with
    ``apply_wd_to_qk_layernorm`` the ``q_layernorm``/``k_layernorm`` parameters keep their
    decay (the Qwen3-Next recipe); with ``decoupled_lr`` every parameter whose attribute
    ``is_embedding_or_output_parameter`` is true gets ``max_lr=decoupled_lr`` (and
    ``min_lr=decoupled_min_lr`` when given).

    Example:
        >>> [key.describe() for key in standard_overrides(decoupled_lr=1e-3)]
        ["name='*.bias', predicate='is_1d'", "attr='is_embedding_or_output_parameter'"]
    """
    overrides: dict[ParamKey, dict[str, Any]] = {}
    # The registered predicates (optzoo.routing.predicates), so these keys can be written to a recipe.
    if apply_wd_to_qk_layernorm:
        not_qk_norm = get_predicate("is_1d_or_bias_not_qk_layernorm")
        assert isinstance(not_qk_norm, ParamWithNamePredicate)
        no_decay = ParamKey(with_name_predicate=not_qk_norm)
    else:
        is_1d = get_predicate("is_1d")
        assert isinstance(is_1d, ParamPredicate)
        no_decay = ParamKey(name="*.bias", predicate=is_1d)
    overrides[no_decay] = {"wd_mult": 0.0}
    if decoupled_lr is not None:
        decoupled: dict[str, Any] = {"max_lr": decoupled_lr}
        if decoupled_min_lr is not None:
            decoupled["min_lr"] = decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter")] = decoupled
    return overrides
