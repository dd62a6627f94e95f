"""Parameter routing: which parameters get which overrides.

The rules, in three sentences:

1. **Order**: every trainable parameter is tested against every key; groups come out with the
   no-override group first, then in the order their first parameter appears in the model.
2. **Merge**: all overrides whose key matches a parameter (under any of its tied names) are
   merged field by field, and parameters with identical merged overrides share one group;
   ``defaults`` (the standard overrides under a user's dict) lie underneath: a field a key sets
   wins over a default's.
3. **Conflict**: two matching keys (or two defaults) that set the same field to different values are an error
   naming the parameter, both keys, the field and both values; a key that matches nothing is
   a warning (an error with ``strict=True``).
"""

from .keys import ParamKey, ParamPredicate, ParamWithNamePredicate
from .predicates import (
    PredicateSpec,
    get_predicate,
    predicate_spec,
    register_predicate,
    registered_predicates,
    unregister_predicate,
)
from .recipes import (
    key_from_entry,
    key_to_entry,
    overrides_from_entries,
    overrides_to_entries,
)
from .dataflow import ParamUse, TraceError, observe
from .inputs import ExampleInputs, example_inputs, trace_uses
from .roles import ROLE_ATTRIBUTE, GuessedRolesWarning, ParamRoles, infer_roles, param_roles
from .resolve import (
    Override,
    ParamGroupSpec,
    RoutedParam,
    Routing,
    RoutingConflictError,
    named_trainable_parameters,
    resolve_param_groups,
)
from .standard import standard_overrides

__all__ = [
    "ROLE_ATTRIBUTE",
    "ExampleInputs",
    "GuessedRolesWarning",
    "ParamUse",
    "TraceError",
    "example_inputs",
    "observe",
    "trace_uses",
    "Override",
    "ParamGroupSpec",
    "ParamKey",
    "ParamPredicate",
    "ParamRoles",
    "ParamWithNamePredicate",
    "PredicateSpec",
    "RoutedParam",
    "Routing",
    "RoutingConflictError",
    "get_predicate",
    "infer_roles",
    "key_from_entry",
    "key_to_entry",
    "named_trainable_parameters",
    "overrides_from_entries",
    "overrides_to_entries",
    "param_roles",
    "predicate_spec",
    "register_predicate",
    "registered_predicates",
    "resolve_param_groups",
    "standard_overrides",
    "unregister_predicate",
]
