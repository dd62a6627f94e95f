"""Config files and routing recipes: read and write ``(config, config_overrides)`` as TOML or YAML.

TOML layout (``docs/cli.md`` and ``docs/routing.md`` have the full reference)::

    [config]                      # OptimizerConfig fields; dtypes as strings ("bfloat16")
    lr = 3e-4
    weight_decay = 0.1

    [[overrides]]                 # one table per ParamKey, in order
    name = ["*.bias", "*layernorm*"]   # globs on the full dotted name (str or list)
    attr = "is_embedding_or_output_parameter"   # attributes (str or list)
    predicate = "is_1d"           # registered predicates (optzoo.routing.register_predicate)
    exclude_name = "*.q_layernorm.*"   # exclude_name/_attr/_predicate: take matches back out
    set = { wd_mult = 0.0 }       # the override: config fields and schedule keys

YAML has the same layout (``config:`` mapping, ``overrides:`` list) and needs PyYAML. Without
an ``overrides`` entry the standard overrides apply (``config_overrides=None``);
``overrides = []`` means none at all. A Python file defines ``config`` (an ``OptimizerConfig``)
and optionally ``config_overrides``. Recipes shipped with optzoo (``optzoo/recipes/*.toml``)
load by name: :func:`load_recipe`, or :func:`load_config_file` with a name that is not a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import runpy
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import torch

from optzoo._common import did_you_mean
from optzoo.config import OptimizerConfig, field_habit
from optzoo.groups import OverrideValue, normalize_overrides
from optzoo.routing import ParamKey, overrides_from_entries, overrides_to_entries

__all__ = [
    "Format",
    "config_from_mapping",
    "config_to_mapping",
    "dump_recipe",
    "load_config_file",
    "load_recipe",
    "overrides_from_list",
    "parse_recipe",
    "recipe_from_overrides",
    "shipped_recipes",
]

Format = Literal["toml", "yaml"]
"""Text formats of a recipe."""

_TOP_LEVEL = ("config", "overrides")
_DTYPE_FIELDS = {
    f.name for f in dataclasses.fields(OptimizerConfig) if f.type in ("torch.dtype", torch.dtype)
}
_YAML_SUFFIXES = (".yaml", ".yml")


# ---- config <-> plain values --------------------------------------------------------------


def _dtype(field: str, value: Any) -> Any:
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return getattr(torch, value)
    raise ValueError(
        f"`config.{field}`: not a torch dtype name; got {value!r}; expected e.g. 'float32' or 'bfloat16'"
    )


def config_from_mapping(values: Any) -> OptimizerConfig:
    """An ``OptimizerConfig`` from plain values; unknown fields list the valid ones."""
    if not isinstance(values, Mapping):
        raise ValueError(f"`config`: must be a table of OptimizerConfig fields; got {values!r}; expected e.g. {{ lr = 3e-4 }}")
    valid = [f.name for f in dataclasses.fields(OptimizerConfig)]
    for field in values:
        if field not in valid:
            if (meant := field_habit(field)) is not None:
                raise ValueError(f"`config.{field}`: not an optzoo field; got {field!r}; expected {meant}")
            raise ValueError(f"`config.{field}`: unknown OptimizerConfig field; got {field!r}; expected one of {valid}{did_you_mean(field, valid)}")
    converted = {k: _dtype(k, v) if k in _DTYPE_FIELDS else v for k, v in values.items()}
    return OptimizerConfig(**converted)


def config_to_mapping(config: OptimizerConfig) -> dict[str, Any]:
    """The fields of ``config`` that differ from ``OptimizerConfig()``, as plain values.

    Raises:
        ValueError: ``timers`` is set (a callable cannot be written down).
    """
    values: dict[str, Any] = {}
    for f in dataclasses.fields(OptimizerConfig):
        value = getattr(config, f.name)
        if value == f.default:
            continue
        if f.name == "timers":
            raise ValueError(f"`config.timers`: cannot be written to a recipe; got {value!r}; expected None")
        values[f.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return values


def overrides_from_list(entries: Any) -> dict[ParamKey, OverrideValue]:
    """``[{name, attr, predicate, exclude_*, set}, ...]`` (TOML's ``[[overrides]]``) as ``{ParamKey: override}``."""
    return dict(overrides_from_entries(entries))


# ---- recipe documents ---------------------------------------------------------------------


def recipe_from_overrides(
    config_overrides: Mapping[ParamKey, OverrideValue] | None, config: OptimizerConfig | None = None
) -> dict[str, Any]:
    """``(config, config_overrides)`` as a recipe document: ``{"config": {...}, "overrides": [...]}``.

    ``config`` is written as its fields that differ from ``OptimizerConfig()`` (left out when
    ``None``); ``config_overrides=None`` leaves ``overrides`` out, which reads back as the
    standard overrides, and ``{}`` writes ``overrides = []``. :func:`dump_recipe` turns the
    document into text, :func:`parse_recipe` reads it back into equal keys and config.

    Raises:
        ValueError: A key holds a predicate that is not registered (recipes name predicates),
            an override field is unknown or model-wide, an ``OptimizerConfig`` override comes
            without ``config`` (it means "the fields that differ from config"), or ``timers`` is set.

    Example:
        >>> from optzoo import get_standard_config_overrides
        >>> config = OptimizerConfig(lr=1e-3)
        >>> recipe_from_overrides(get_standard_config_overrides(config), config)
        {'config': {'lr': 0.001}, 'overrides': [{'name': '*.bias', 'predicate': 'is_1d', 'role': ['bias', 'norm', 'elementwise'], 'set': {'wd_mult': 0.0}}]}
    """
    document: dict[str, Any] = {}
    if config is not None:
        document["config"] = config_to_mapping(config)
    if config_overrides is not None:
        if config is None and any(isinstance(v, OptimizerConfig) for v in config_overrides.values()):
            raise ValueError(
                "`config_overrides`: an OptimizerConfig override means its fields that differ from the config; "
                "got one without config; expected recipe_from_overrides(config_overrides, config)"
            )
        document["overrides"] = overrides_to_entries(normalize_overrides(config or OptimizerConfig(), config_overrides))
    return document


def _document(where: str, document: Any) -> tuple[OptimizerConfig, dict[ParamKey, OverrideValue] | None]:
    if document is None:  # an empty YAML file
        document = {}
    if not isinstance(document, Mapping):
        raise ValueError(
            f"`{where}`: must be a table with keys 'config' and 'overrides'; got {type(document).__name__}; "
            "expected config: {...} and overrides: [...]"
        )
    for key in document:
        if key not in _TOP_LEVEL:
            raise ValueError(f"`{where}`: unknown top-level key; got {key!r}; expected 'config' and 'overrides'")
    config = config_from_mapping(document.get("config", {}))
    if "overrides" not in document:
        return config, None
    return config, overrides_from_list(document["overrides"])


def parse_recipe(
    text: str, format: Format = "toml", *, where: str = "recipe"
) -> tuple[OptimizerConfig, dict[ParamKey, OverrideValue] | None]:
    """Read ``(config, config_overrides)`` from TOML or YAML text.

    Raises:
        ValueError: Invalid TOML or YAML, a duplicate key (TOML and YAML alike), a YAML plain scalar
            that YAML 1.1 reads as another value than YAML 1.2 (``0755``, ``1:30``, ``yes``), nesting
            deeper than :data:`MAX_DEPTH`, an unknown top-level key, config field or entry key,
            or a bad entry (unknown predicate, missing ``set``, duplicate rule, ...).
        ImportError: YAML without PyYAML installed.
    """
    if format not in ("toml", "yaml"):
        raise ValueError(f"`format`: unknown recipe format; got {format!r}; expected 'toml' or 'yaml'")
    try:  # both parsers recurse once per level: a deep enough document exhausts Python's stack
        if format == "yaml":
            document = _yaml_load(text, where)
        else:
            try:
                document = tomllib.loads(text)
            except tomllib.TOMLDecodeError as error:
                raise ValueError(f"`{where}`: invalid TOML; got {error}; expected a TOML document") from None
    except RecursionError:
        raise _too_deep(where, "more levels than the parser can recurse through (Python's recursion limit)") from None
    _check_depth(document, where)
    return _document(where, document)


def dump_recipe(recipe: Mapping[str, Any], format: Format = "toml") -> str:
    """A recipe document (:func:`recipe_from_overrides`) as TOML or YAML text.

    Raises:
        ValueError: An unknown top-level key, or a value TOML cannot hold (``None``, objects).
        ImportError: YAML without PyYAML installed.

    Example:
        >>> print(dump_recipe({"config": {"lr": 0.001}, "overrides": [{"predicate": "is_1d", "set": {"wd_mult": 0.0}}]}))
        [config]
        lr = 0.001
        <BLANKLINE>
        [[overrides]]
        predicate = "is_1d"
        set = { wd_mult = 0.0 }
        <BLANKLINE>
    """
    for key in recipe:
        if key not in _TOP_LEVEL:
            raise ValueError(f"`recipe`: unknown top-level key; got {key!r}; expected 'config' and 'overrides'")
    if format == "yaml":
        return _yaml_dump(dict(recipe))
    if format != "toml":
        raise ValueError(f"`format`: unknown recipe format; got {format!r}; expected 'toml' or 'yaml'")
    sections: list[list[str]] = []
    overrides = recipe.get("overrides")
    if overrides is not None and not overrides:
        sections.append(["overrides = []"])  # a top-level key must come before the first table
    if "config" in recipe:
        config = recipe["config"]
        sections.append(["[config]", *(f"{_toml_key(k)} = {_toml_value(f'config.{k}', v)}" for k, v in config.items())])
    for index, entry in enumerate(overrides or []):
        where = f"overrides[{index}]"
        sections.append(["[[overrides]]", *(f"{_toml_key(k)} = {_toml_value(f'{where}.{k}', v)}" for k, v in entry.items())])
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key, ensure_ascii=False)


def _toml_value(where: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        # JSON's escapes are valid in TOML basic strings; ensure_ascii=False avoids surrogate pairs.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(f"{where}[{i}]", v) for i, v in enumerate(value)) + "]"
    if isinstance(value, Mapping):
        inner = ", ".join(f"{_toml_key(k)} = {_toml_value(f'{where}.{k}', v)}" for k, v in value.items())
        return "{ " + inner + " }" if inner else "{}"
    raise ValueError(
        f"`{where}`: TOML cannot hold this value; got {value!r} ({type(value).__name__}); "
        "expected a bool, number, string, list or table"
    )


# ---- YAML (optional) ----------------------------------------------------------------------


def _no_yaml(where: str) -> ImportError:
    return ImportError(
        f"`{where}`: YAML needs PyYAML; got no module named 'yaml'; expected `pip install pyyaml`, or a TOML file"
    )


MAX_DEPTH = 32
"""The deepest nesting of tables and lists a recipe may have (one needs 4: ``overrides`` → entry →
``set`` → a list of names); deeper documents are refused before anything walks them recursively."""

_YAML_CORE: tuple[tuple[str, str, str], ...] = (
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", "~nN"),
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        "tag:yaml.org,2002:float",
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+0123456789.",
    ),
    ("tag:yaml.org,2002:merge", r"^(?:<<)$", "<"),
)
"""YAML 1.2's core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), plus merge keys (``<<``):
``yes``/``on``/``0755``/``1:30``/``1_000``/``2024-01-01`` are not the bools, octal or base-60
numbers and dates YAML 1.1 (PyYAML's default) reads them as."""


def _yaml_int(text: str) -> int:
    """A YAML 1.2 core int (decimal, ``0o`` octal or ``0x`` hex): ``0755`` is 755, not 1.1's 493."""
    if text.startswith(("0o", "0x")):
        return int(text[2:], 8 if text[1] == "o" else 16)
    return int(text)


def _yaml_load(text: str, where: str) -> Any:
    """YAML, read as 1.2 core (ints and bools) with PyYAML, refusing duplicate keys (PyYAML keeps the
    last one silently) and plain scalars that YAML 1.1 would read as another value (``0755``,
    ``1:30``, ``yes``): a file written for either reader means one thing or is refused."""
    try:
        import yaml
    except ImportError:
        raise _no_yaml(where) from None

    yaml11: Any = yaml.resolver.Resolver()  # YAML 1.1, to tell which plain scalars it reads otherwise
    constructor11 = yaml.constructor.SafeConstructor()
    string = "tag:yaml.org,2002:str"
    ambiguous = {f"tag:yaml.org,2002:{kind}" for kind in ("bool", "int", "float", "timestamp")}  # 1.1's readings of plain text

    class Loader(yaml.SafeLoader):
        yaml_implicit_resolvers: dict[Any, Any] = {}

        def compose_scalar_node(self, anchor: Any) -> Any:
            node = super().compose_scalar_node(anchor)
            if node.style is None:  # plain (unquoted): its tag came from the schema
                old_tag = yaml11.resolve(yaml.ScalarNode, node.value, (True, False))
                if old_tag in ambiguous:
                    old = constructor11.construct_object(yaml.ScalarNode(old_tag, node.value))
                    new = self.construct_object(node) if node.tag != string else node.value
                    if old_tag != node.tag or type(old) is not type(new) or old != new:
                        raise ValueError(
                            f"`{where}`: line {node.start_mark.line + 1}: ambiguous plain scalar {node.value!r}; got "
                            f"{old!r} in YAML 1.1 (PyYAML's default), {new!r} in YAML 1.2; expected quotes for a "
                            "string, a decimal number without leading zeros (or 0o/0x), or true/false"
                        )
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise ValueError(
                        f"`{where}`: line {line}: duplicate key {key_node.value!r} (first at line {seen[key]}); "
                        "got the key twice in one mapping; expected each key once (PyYAML would keep the last value)"
                    )
                seen[key] = line
            return super().construct_mapping(node, deep=deep)

    for tag, pattern, first in _YAML_CORE:
        Loader.add_implicit_resolver(tag, re.compile(pattern), list(first) + ([""] if tag.endswith("null") else []))
    def construct_int(loader: Any, node: Any) -> int:
        return _yaml_int(loader.construct_scalar(node))

    Loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    try:
        return yaml.load(text, Loader=Loader)
    except yaml.YAMLError as error:
        raise ValueError(f"`{where}`: invalid YAML; got {' '.join(str(error).split())}; expected a YAML mapping") from None


def _check_depth(document: Any, where: str) -> None:
    """Refuse a document nested deeper than :data:`MAX_DEPTH` (walked without recursion)."""
    stack = [(document, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (Mapping, list)):
            if depth >= MAX_DEPTH:
                raise _too_deep(where, f"more than {MAX_DEPTH} levels")
            children = value.values() if isinstance(value, Mapping) else value
            stack.extend((child, depth + 1) for child in children)


def _too_deep(where: str, got: str) -> ValueError:
    return ValueError(f"`{where}`: nested too deeply; got {got}; expected at most {MAX_DEPTH} levels of tables and lists (a recipe needs 4)")


def _yaml_dump(document: dict[str, Any]) -> str:
    try:
        import yaml
    except ImportError:
        raise _no_yaml("recipe") from None
    text: str = yaml.safe_dump(document, sort_keys=False)
    return text


# ---- files and shipped recipes ------------------------------------------------------------


def _recipe_dir() -> Any:
    return resources.files("optzoo").joinpath("recipes")


def shipped_recipes() -> dict[str, str]:
    """The recipes shipped with optzoo: ``{name: one-line description}``, sorted by name.

    Example:
        >>> sorted(shipped_recipes())
        ['adamw-no-decay-norms', 'lion-llm', 'muon-llm']
    """
    found = {}
    for entry in _recipe_dir().iterdir():
        if entry.name.endswith(".toml"):
            first = entry.read_text().splitlines()[0]
            found[entry.name.removesuffix(".toml")] = first.lstrip("#").strip()
    return dict(sorted(found.items()))


def load_recipe(name: str) -> tuple[OptimizerConfig, dict[ParamKey, OverrideValue] | None]:
    """``(config, config_overrides)`` of a shipped recipe (:func:`shipped_recipes`).

    Raises:
        ValueError: Unknown name; the message lists the shipped recipes.

    Example:
        >>> config, overrides = load_recipe("muon-llm")
        >>> [key.describe() for key in overrides]
        ["with_name_predicate='is_embedding_or_output', role=('embedding', 'output')", "predicate='is_1d', role=('bias', 'norm', 'elementwise')"]
    """
    shipped = shipped_recipes()
    if name not in shipped:
        raise ValueError(f"`recipe`: unknown recipe; got {name!r}; expected one of {list(shipped)}{did_you_mean(name, shipped)}")
    return parse_recipe(_recipe_dir().joinpath(f"{name}.toml").read_text(), where=f"recipe {name}")


def load_config_file(path: str | Path) -> tuple[OptimizerConfig, dict[ParamKey, OverrideValue] | None]:
    """Load ``(config, config_overrides)`` from a ``.py``, ``.yaml``/``.yml`` or TOML file, or a
    shipped recipe named ``path`` when no such file exists.

    Raises:
        FileNotFoundError: No such file (nor shipped recipe).
        ValueError: Bad TOML or YAML, unknown fields or keys, or a Python file without ``config``.
        ImportError: A YAML file without PyYAML installed.
    """
    path = Path(path)
    try:
        exists = path.is_file()
    except OSError as error:  # a name too long for the file system, ...
        raise ValueError(f"`--config`: cannot be read; got {str(path)[:80]!r}: {error.strerror or error}; expected a readable file") from None
    if not exists:
        name = str(path)
        if name in shipped_recipes():
            return load_recipe(name)
        if not path.suffix and "/" not in name and "\\" not in name:
            raise FileNotFoundError(
                f"`--config`: no such file or shipped recipe; got {name!r}; expected a .toml, .yaml or .py "
                f"file, or one of {list(shipped_recipes())}{did_you_mean(name, shipped_recipes())}"
            )
        raise FileNotFoundError(f"`--config`: no such file; got {name!r}; expected a .toml or .py file")
    if path.suffix == ".py":
        try:
            namespace = runpy.run_path(str(path))
        except (Exception, SystemExit) as error:  # user code: report it in one line, whatever it raised
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
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ValueError(
                f"`{path}`: `config_overrides` must be a dict of ParamKey -> override; got {type(overrides).__name__}; "
                "expected config_overrides = {ParamKey(...): {...}}, or leave it out"
            )
        return config, None if overrides is None else dict(overrides)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"`--config`: not UTF-8 text; got {str(path)!r} ({error.reason} at byte {error.start}); expected a text file") from None
    except OSError as error:
        raise ValueError(f"`--config`: cannot be read; got {str(path)!r}: {error.strerror or error}; expected a readable file") from None
    return parse_recipe(text, "yaml" if path.suffix in _YAML_SUFFIXES else "toml", where=str(path))
