"""The standard overrides Megatron-Core applies when ``config_overrides`` is ``None``."""

from __future__ import annotations

from typing import Any

from .keys import ParamKey, ParamPredicate, ParamWithNamePredicate
from .predicates import get_predicate

__all__ = ["standard_overrides"]

_NO_DECAY_ROLES = ("bias", "norm", "elementwise")
"""Roles the standard rule keeps out of weight decay, whatever their rank: biases (GPT-OSS's 2-D
expert bias stacks), norms, and elementwise params (gains of any shape, SSM parameters, logit scales)."""


def standard_overrides(
    *,
    decoupled_lr: float | None = None,
    decoupled_min_lr: float | None = None,
    apply_wd_to_qk_layernorm: bool = False,
) -> dict[ParamKey, dict[str, Any]]:
    """No weight decay on biases, norms and 1-D parameters; optionally a decoupled embedding/output lr.

    Megatron-Core's ``get_standard_config_overrides``, extended with roles
    (:mod:`optzoo.routing.roles`): its no-decay rule (``*.bias`` or 1-D) also takes every
    parameter whose role is ``bias``, ``norm`` or ``elementwise`` (GPT-OSS's 2-D expert bias
    stacks, ``[1, 1, C]`` gains, Mamba's 2-D ``A_log``, 0-D logit scales), and
    ``decoupled_lr`` applies to the parameters tagged ``is_embedding_or_output_parameter`` and to
    every ``embedding`` and ``output`` role (the same set on a Megatron-tagged model, whose tags
    decide those roles). With ``apply_wd_to_qk_layernorm`` the ``q_layernorm``/``k_layernorm``
    parameters keep their decay (the Qwen3-Next recipe); ``decoupled_min_lr`` goes with
    ``decoupled_lr``.

    Example:
        >>> [key.describe() for key in standard_overrides(decoupled_lr=1e-3)]
        ["name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise')", "attr='is_embedding_or_output_parameter', role=('embedding', 'output')"]
    """
    overrides: dict[ParamKey, dict[str, Any]] = {}
    # The registered predicates (optzoo.routing.predicates), so these keys can be written to a recipe.
    if apply_wd_to_qk_layernorm:
        not_qk_norm = get_predicate("is_1d_or_bias_not_qk_layernorm")
        assert isinstance(not_qk_norm, ParamWithNamePredicate)
        # Megatron's test is on the name, character for character: so is the exclusion of the roles.
        qk_norm = ParamKey(name=("*q_layernorm.*", "*k_layernorm.*"))
        no_decay = ParamKey(with_name_predicate=not_qk_norm, role=_NO_DECAY_ROLES, exclude=qk_norm)
    else:
        is_1d = get_predicate("is_1d")
        assert isinstance(is_1d, ParamPredicate)
        no_decay = ParamKey(name="*.bias", predicate=is_1d, role=_NO_DECAY_ROLES)
    overrides[no_decay] = {"wd_mult": 0.0}
    if decoupled_lr is not None:
        decoupled: dict[str, Any] = {"max_lr": decoupled_lr}
        if decoupled_min_lr is not None:
            decoupled["min_lr"] = decoupled_min_lr
        overrides[ParamKey(attr="is_embedding_or_output_parameter", role=("embedding", "output"))] = decoupled
    return overrides
