"""Read an optimizer config and its overrides from a TOML or Python file.

TOML layout (``docs/cli.md`` has the full reference)::

    [config]                      # OptimizerConfig fields; dtypes as strings ("bfloat16")
    lr = 3e-4
    weight_decay = 0.1

    [[overrides]]                 # one table per ParamKey, in order
    name = ["*.bias", "*layernorm*"]   # globs on the full dotted name (str or list)
    attr = "is_embedding_or_output_parameter"   # attributes (str or list)
    set = { wd_mult = 0.0 }       # the override: config fields and schedule keys

Without an ``overrides`` entry the standard overrides apply (``config_overrides=None``);
``overrides = []`` means none at all. A Python file defines ``config`` (an ``OptimizerConfig``)
and optionally ``config_overrides``.
"""

from __future__ import annotations

import dataclasses
import runpy
import tomllib
from pathlib import Path
from typing import Any

import torch

from optzoo.config import OptimizerConfig
from optzoo.groups import OverrideValue
from routing import ParamKey

_OVERRIDE_TABLE_KEYS = ("name", "attr", "set")
_DTYPE_FIELDS = {
    f.name for f in dataclasses.fields(OptimizerConfig) if f.type in ("torch.dtype", torch.dtype)
}


def _dtype(field: str, value: Any) -> Any:
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    raise ValueError(
        f"`config.{field}`: not a torch dtype name; got {value!r}; expected e.g. 'float32' or 'bfloat16'"
    )


def config_from_mapping(values: dict[str, Any]) -> OptimizerConfig:
    """An ``OptimizerConfig`` from plain values; unknown fields list the valid ones."""
    valid = [f.name for f in dataclasses.fields(OptimizerConfig)]
    for field in values:
        if field not in valid:
            raise ValueError(f"`config.{field}`: unknown OptimizerConfig field; got {field!r}; expected one of {valid}")
    converted = {k: _dtype(k, v) if k in _DTYPE_FIELDS else v for k, v in values.items()}
    return OptimizerConfig(**converted)


def _as_str_tuple(where: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"`{where}`: must be a string or a list of strings; got {value!r}; expected e.g. '*.bias'")
    return tuple(items)


def overrides_from_list(entries: Any) -> dict[ParamKey, OverrideValue]:
    """``[{name, attr, set}, ...]`` (TOML's ``[[overrides]]``) as ``{ParamKey: override}``."""
    if not isinstance(entries, list):
        raise ValueError(f"`overrides`: must be a list of tables; got {entries!r}; expected [[overrides]] tables")
    overrides: dict[ParamKey, OverrideValue] = {}
    for index, entry in enumerate(entries):
        where = f"overrides[{index}]"
        if not isinstance(entry, dict):
            raise ValueError(f"`{where}`: must be a table; got {entry!r}; expected keys {list(_OVERRIDE_TABLE_KEYS)}")
        for key in entry:
            if key not in _OVERRIDE_TABLE_KEYS:
                raise ValueError(f"`{where}.{key}`: unknown key; got {key!r}; expected one of {list(_OVERRIDE_TABLE_KEYS)}")
        values = entry.get("set")
        if not isinstance(values, dict) or not values:
            raise ValueError(f"`{where}.set`: must be a non-empty table of fields; got {values!r}; expected e.g. {{ wd_mult = 0.0 }}")
        key = ParamKey(
            name=_as_str_tuple(f"{where}.name", entry.get("name", [])),
            attr=_as_str_tuple(f"{where}.attr", entry.get("attr", [])),
        )
        if key in overrides:
            raise ValueError(f"`{where}`: duplicate rule; got {key.describe()} twice; expected each rule once")
        overrides[key] = dict(values)
    return overrides


def load_config_file(path: str | Path) -> tuple[OptimizerConfig, dict[ParamKey, OverrideValue] | None]:
    """Load ``(config, config_overrides)`` from a ``.toml`` or ``.py`` file.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Bad TOML, unknown fields or keys, or a Python file without ``config``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"`--config`: no such file; got {str(path)!r}; expected a .toml or .py file")
    if path.suffix == ".py":
        try:
            namespace = runpy.run_path(str(path))
        except Exception as error:  # user code: report it in one line, whatever it raised
            raise ValueError(
                f"`--config`: running the file failed; got {str(path)!r} raising {type(error).__name__}: "
                f"{error}; expected it to define config (and optionally config_overrides)"
            ) from error
        config = namespace.get("config")
        if not isinstance(config, OptimizerConfig):
            raise ValueError(
                f"`{path}`: must define `config` as an OptimizerConfig; got {type(config).__name__}; "
                "expected config = OptimizerConfig(...)"
            )
        overrides = namespace.get("config_overrides")
        return config, None if overrides is None else dict(overrides)
    try:
        document = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"`{path}`: invalid TOML; got {error}; expected a TOML document") from None
    for key in document:
        if key not in ("config", "overrides"):
            raise ValueError(f"`{path}`: unknown top-level key; got {key!r}; expected 'config' and 'overrides'")
    config = config_from_mapping(document.get("config", {}))
    if "overrides" not in document:
        return config, None
    return config, overrides_from_list(document["overrides"])
