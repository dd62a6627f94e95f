"""The ``optzoo`` command line: ``list``, ``dump-param-groups``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import sys
import tomllib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from tabulate import tabulate

from optzoo.optimizers.registry import get_spec, registered_names
from optzoo.config import OptimizerConfig
from optzoo.config_file import load_config_file
from optzoo.distributed import Mode, Shard, ShardingPlan, plan_shards
from optzoo.factory import param_group_map
from optzoo.groups import ResolvedGroup, _jsonable, qualified_names, resolve_groups
from optzoo.models import BUILTIN_MODELS, build_model
from optzoo.routing import Routing

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


def _owner_text(shards: Sequence[Shard]) -> str:
    """``1`` for a param one rank owns whole; ``0[0:44] 1[44:64]`` for one split into ranges."""
    if len(shards) == 1 and shards[0].whole:
        return str(shards[0].rank)
    return " ".join(f"{s.rank}[{s.start}:{s.stop}]" for s in shards)


def owner_shards(groups: Sequence[ResolvedGroup], plan: ShardingPlan, num_chunks: int) -> dict[str, list[Shard]]:
    """``{name: shards}`` for every parameter name, tied names included (they share the shards)."""
    by_canonical: dict[str, list[Shard]] = {}
    for shard in plan.shards:
        by_canonical.setdefault(shard.name, []).append(shard)
    result: dict[str, list[Shard]] = {}
    for group in groups:
        for routed, canonical in zip(group.params, group.param_names):
            for name in qualified_names(routed, num_chunks):
                result[name] = by_canonical[canonical]
    return result


def rank_rows(plan: ShardingPlan) -> list[dict[str, Any]]:
    """Per rank: params it holds (a split param counts on each of its ranks), state elements, load."""
    loads, elements = plan.loads(), plan.state_elements()
    total = sum(loads)
    counts = [len({(s.group, s.index) for s in plan.owned(rank)}) for rank in range(plan.world_size)]
    return [
        {"rank": rank, "params": counts[rank], "state_elements": elements[rank], "load_flops": loads[rank],
         "share": loads[rank] / total if total else 0.0}
        for rank in range(plan.world_size)
    ]  # fmt: skip


def _gflop(flops: float) -> str:
    """GFLOP to 4 significant digits without an exponent (loads span 1e-3 to 1e4 GFLOP)."""
    gflop = flops / 1e9
    return f"{gflop:.{max(0, 3 - math.floor(math.log10(gflop)))}f}" if gflop > 0 else "0"


RANK_HEADERS = ["rank", "params owned", "state elements", "load (GFLOP/step)", "share (%)"]


def _distributed_mode(args: argparse.Namespace, config: OptimizerConfig) -> Mode:
    """``--distributed-mode``, else the config's flag (as ``get_optimizer`` picks), else layer_wise."""
    from_config: Mode | None = (
        "layer_wise" if config.use_layer_wise_distributed_optimizer
        else "sharded" if config.use_distributed_optimizer
        else None
    )  # fmt: skip
    if args.distributed_mode is None:
        return from_config or "layer_wise"
    if from_config is not None and from_config != args.distributed_mode:
        flag = "use_layer_wise_distributed_optimizer" if from_config == "layer_wise" else "use_distributed_optimizer"
        print(f"optzoo: warning: `--distributed-mode {args.distributed_mode}` overrides the config's {flag}=True; "
              f"showing the {args.distributed_mode} plan", file=sys.stderr)  # fmt: skip
    mode: Mode = args.distributed_mode
    return mode


def _cmd_dump(args: argparse.Namespace) -> int:
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"`--world-size`: must be at least 1; got {args.world_size}; expected an integer >= 1")
    if args.distributed_mode is not None and args.world_size is None:
        raise ValueError(
            f"`--distributed-mode`: needs --world-size; got --distributed-mode {args.distributed_mode} "
            "without it; expected --world-size N as well"
        )
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
    # The plan every rank of get_optimizer would compute: it needs only shapes, so meta is enough.
    plan = None if args.world_size is None else plan_shards(groups, args.world_size, _distributed_mode(args, config))
    owners = {} if plan is None else owner_shards(groups, plan, len(chunks))
    if args.format == "json":
        document = param_group_map(groups, routing, len(chunks))
        if not args.explain:
            document.pop("matched_rules")
        for group in document["groups"]:
            group.pop("config")
        if plan is not None:
            document["world_size"] = plan.world_size
            document["distributed_mode"] = plan.mode
            document["owners"] = {
                name: [{"rank": s.rank, "start": s.start, "stop": s.stop} for s in shards] for name, shards in owners.items()
            }
            document["ranks"] = rank_rows(plan)
        print(json.dumps(document, indent=2))
        return 0
    print(tabulate(group_rows(groups), headers=GROUP_HEADERS, tablefmt="simple"))
    if args.explain or plan is not None:
        rows = explain_rows(groups, routing, len(chunks))
        headers = ["parameter", "group", "shape", "matched rules"]
        if not args.explain:
            rows, headers = [row[:3] for row in rows], headers[:3]
        if plan is not None:
            rows, headers = [[*row, _owner_text(owners[row[0]])] for row in rows], [*headers, "owner"]
        print()
        print(tabulate(rows, headers=headers, tablefmt="simple"))
    if plan is not None:
        table = [[r["rank"], r["params"], r["state_elements"], _gflop(r["load_flops"]), 100 * r["share"]] for r in rank_rows(plan)]
        print()
        print(f"{plan.mode} plan over {plan.world_size} rank{'s' if plan.world_size > 1 else ''}:")
        print(tabulate(table, headers=RANK_HEADERS, tablefmt="simple", floatfmt=".1f", disable_numparse=[3], colalign=("right",) * 5))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from optzoo.demo import run_demo

    run_demo(steps=args.steps)
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # The suite is the repository's benchmarks/compare.py: the wheel does not ship benchmarks/, and
    # optzoo must not depend on it. An editable install maps only the three packages, so look for
    # the checkout next to this package (or in the working directory) and import the suite from it.
    for root in (Path(__file__).resolve().parents[1], Path.cwd()):
        if (root / "benchmarks" / "compare.py").is_file():
            if str(root) not in sys.path:
                sys.path.insert(0, str(root))
            break
    try:
        compare = importlib.import_module("benchmarks.compare")
    except ModuleNotFoundError as error:
        if error.name not in ("benchmarks", "benchmarks.compare"):
            raise
        raise ImportError(
            "`optzoo bench`: the suite is benchmarks/compare.py of the source repository, which the installed "
            f"package does not ship; got no module {error.name!r}; expected optzoo installed from a checkout "
            "(`pip install -e .`) or the checkout's root as the working directory"
        ) from None
    compare.run_suite(device=args.device, out=args.out, quick=args.quick)
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
    dump.add_argument(
        "--world-size", type=int, metavar="N",
        help="also show the distributed optimizer's plan over N ranks: each param's owner and each rank's load",
    )
    dump.add_argument(
        "--distributed-mode", choices=["layer_wise", "sharded"],
        help="the plan with --world-size (default: sharded if the config sets use_distributed_optimizer, else layer_wise)",
    )
    dump.set_defaults(run=_cmd_dump)

    demo = commands.add_parser("demo", help="train the built-in GPT on the standard library's source")
    demo.add_argument("--steps", type=int, default=120)
    demo.set_defaults(run=_cmd_demo)

    bench = commands.add_parser(
        "bench", help="the comparison suite: step time, Newton-Schulz, memory, convergence; tables, JSON and PNG plots"
    )
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available, else cpu")
    bench.add_argument("--out", help="folder for results.json and the plots (default: benchmarks/results/)")
    bench.add_argument("--quick", action="store_true", help="toy sizes: the whole pipeline in seconds, numbers meaningless")
    bench.set_defaults(run=_cmd_bench)
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
