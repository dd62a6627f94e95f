"""The ``optzoo`` command line: ``list``, ``dump-param-groups`` and ``demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from tabulate import tabulate

from optimizers.registry import get_spec, registered_names
from optzoo.config import OptimizerConfig
from optzoo.config_file import load_config_file
from optzoo.factory import param_group_map
from optzoo.groups import ResolvedGroup, _jsonable, qualified_names, resolve_groups
from optzoo.models import BUILTIN_MODELS, build_model
from routing import Routing

DEFAULT_LR = 1e-3
"""lr of the config ``dump-param-groups`` uses when no ``--config`` is given."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage block: the brief asks for a single clear line and status 2.
        self.exit(2, f"optzoo: error: {message} (see `{self.prog} --help`)\n")


def _list_rows() -> list[dict[str, Any]]:
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    rows = []
    for name in registered_names():
        spec = get_spec(name)
        fields = ("lr", "weight_decay", *spec.config_fields)
        rows.append(
            {
                "name": name,
                "source": spec.source,
                "shapes": spec.shapes,
                "fields": {f: _jsonable(defaults[f]) for f in fields},
                "description": spec.description,
            }
        )
    return rows


def _cmd_list(args: argparse.Namespace) -> int:
    rows = _list_rows()
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    table = [
        (r["name"], r["source"], r["shapes"], "\n".join(f"{k}={v}" for k, v in r["fields"].items()), r["description"])
        for r in rows
    ]
    print(tabulate(table, headers=["name", "source", "shapes", "config fields (defaults)", "description"], tablefmt="simple_grid"))
    return 0


def _format_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def group_rows(groups: Sequence[ResolvedGroup]) -> list[list[Any]]:
    """One row per group: index, optimizer, lr, weight decay, other overrides, counts."""
    rows = []
    for group in groups:
        others = {k: v for k, v in group.override.items() if k not in ("optimizer", "lr", "max_lr", "weight_decay", "wd_mult")}
        rows.append(
            [
                group.index,
                group.optimizer,
                _format_value(group.lr),
                _format_value(group.weight_decay),
                ", ".join(f"{k}={_format_value(v)}" for k, v in others.items()) or "-",
                len(group.params),
                sum(p.param.numel() for p in group.params),
            ]
        )
    return rows


GROUP_HEADERS = ["group", "optimizer", "lr", "weight_decay", "other overrides", "params", "elements"]


def explain_rows(groups: Sequence[ResolvedGroup], routing: Routing, num_chunks: int) -> list[list[Any]]:
    """One row per parameter name: name, group, shape, the rules that matched it."""
    rows = []
    for group in groups:
        for routed in group.params:
            reasons = [f"#{k} {routing.keys[k].describe()}" for k in routed.matched]
            if group.auto_routed:
                reasons.append(group.auto_routed)
            for name in qualified_names(routed, num_chunks):
                rows.append([name, group.index, "x".join(map(str, routed.param.shape)) or "scalar", "; ".join(reasons) or "-"])
    return rows


def _cmd_dump(args: argparse.Namespace) -> int:
    if args.config:
        config, overrides = load_config_file(args.config)
    else:
        config, overrides = OptimizerConfig(lr=DEFAULT_LR), None
    model = build_model(args.model)
    chunks = model if isinstance(model, list) else [model]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups, routing = resolve_groups(config, chunks, overrides, strict=args.strict)
    for warning in caught:
        print(f"optzoo: warning: {warning.message}", file=sys.stderr)
    if args.format == "json":
        document = param_group_map(groups, routing, len(chunks))
        if not args.explain:
            document.pop("matched_rules")
        for group in document["groups"]:
            group.pop("config")
        print(json.dumps(document, indent=2))
        return 0
    print(tabulate(group_rows(groups), headers=GROUP_HEADERS, tablefmt="simple"))
    if args.explain:
        print()
        print(tabulate(explain_rows(groups, routing, len(chunks)), headers=["parameter", "group", "shape", "matched rules"], tablefmt="simple"))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from optzoo.demo import run_demo

    run_demo(steps=args.steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="optzoo", description="A zoo of PyTorch optimizers with parameter-group routing.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    listing = commands.add_parser("list", help="the registered optimizers and the config fields they read")
    listing.add_argument("--format", choices=["table", "json"], default="table")
    listing.set_defaults(run=_cmd_list)

    dump = commands.add_parser("dump-param-groups", help="show how a model's parameters are grouped")
    dump.add_argument(
        "--model", required=True,
        help=f"built-in model ({', '.join(sorted(BUILTIN_MODELS))}) or package.module:callable; built on the meta device",
    )
    dump.add_argument("--config", help=f"TOML or Python file with config and overrides (default: lr={DEFAULT_LR}, standard overrides)")
    dump.add_argument("--explain", action="store_true", help="add one row per parameter with the rules that matched it")
    dump.add_argument("--format", choices=["table", "json"], default="table")
    dump.add_argument("--strict", action="store_true", help="a rule that matches nothing is an error")
    dump.set_defaults(run=_cmd_dump)

    demo = commands.add_parser("demo", help="train the built-in GPT on the standard library's source")
    demo.add_argument("--steps", type=int, default=120)
    demo.set_defaults(run=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``optzoo`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
        return status
    except (ValueError, TypeError, KeyError, ImportError, FileNotFoundError, tomllib.TOMLDecodeError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, ImportError) and not message.startswith("`"):
            message = f"`--model`: cannot import; got {message}"
        print(f"optzoo: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
