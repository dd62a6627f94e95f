"""The ``optzoo`` command line: ``list``, ``recipes``, ``dump-param-groups``, ``estimate``, ``lint`` and ``demo``.

Text output fits the width :func:`optzoo.reporting.output_width` gives (``COLUMNS``, else the
terminal's, else 80 when piped): tables move long cells under their row or wrap them, and long
lines wrap with indented continuations. JSON output is never wrapped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import re
import sys
import tomllib
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, get_args

from tabulate import tabulate

from optzoo._common import did_you_mean, show_value
from optzoo.config import OptimizerConfig
from optzoo.config_file import load_config_file, shipped_recipes
from optzoo.distributed.plan import Mode, plan_shards
from optzoo.distributed.setup import is_expert
from optzoo.estimate import Distributed, estimate_groups
from optzoo.groups import OverrideValue, ResolvedGroup, resolve_group_configs
from optzoo.lint import Finding, findings_as_json, lint_routing
from optzoo.mesh_plan import (
    DEFAULT_TP_PLAN,
    MeshPlan,
    MeshSpec,
    gathered_params,
    model_tp_plan,
    parse_bytes,
    parse_mesh,
    parse_tp_plan,
    plan_mesh,
)
from optzoo.models import BUILTIN_MODELS, build_model
from optzoo.optimizers.owner_compute import TPMode
from optzoo.reporting import (
    EXPLAIN_HEADERS,
    GROUP_HEADERS,
    OPTIMIZER_HEADERS,
    RANK_HEADERS,
    estimate_group_rows,
    ESTIMATE_GROUP_HEADERS,
    estimate_rank_table,
    estimate_summary,
    explain_rows,
    newton_schulz_rows,
    NEWTON_SCHULZ_HEADERS,
    fit_table,
    format_gflop,
    group_rows,
    optimizer_rows,
    output_width,
    owner_compute_text,
    owner_shards,
    owner_text,
    param_group_map,
    rank_rows,
    widest_line,
    wrap_lines,
)
from optzoo.routing import ParamKey, Routing, named_trainable_parameters
from optzoo.wrapper.param_map import check_param_dtypes

if TYPE_CHECKING:
    import torch

__all__ = ["LINT_EXIT_STATUS", "build_parser", "main"]

DEFAULT_LR = 1e-3
"""lr of the config ``dump-param-groups`` uses when no ``--config`` is given."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, no usage block: the brief asks for a single clear line and status 2.
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        hint = did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2))) if choice else ""
        unknown = re.search(r"unrecognized arguments: (--?[\w-]+)", message)
        if unknown:  # a misspelt flag: the close one among every command's flags
            hint = did_you_mean(unknown.group(1), _option_strings(self))
        self.exit(2, _for_stderr(f"optzoo: error: {message}{hint} (see `{self.prog} --help`)") + "\n")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """The flags of ``parser`` and of its commands' parsers."""
    found: list[str] = []
    for action in parser._actions:  # argparse keeps them here; there is no public accessor
        found += action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _option_strings(sub)
    return sorted(set(found))


def _for_stderr(line: str) -> str:
    """A message line for stderr: wrapped to the terminal when stderr is one, else one line for
    scripts (``optzoo: error: ...`` stays greppable in logs and pipes)."""
    try:
        if sys.stderr.isatty():
            return wrap_lines(line, output_width())
    except (ValueError, AttributeError):  # a closed or replaced stderr
        pass
    return line


def _warn(message: object) -> None:
    print(_for_stderr(f"optzoo: warning: {message}"), file=sys.stderr)


def _version() -> str:
    """``optzoo X (torch Y, emerging-optimizers Z, Python W)``: what a bug report needs."""
    import torch

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return (
        f"optzoo {installed('optzoo')} (torch {torch.__version__}, "
        f"emerging-optimizers {installed('emerging-optimizers')}, Python {python})"
    )


def _cmd_list(args: argparse.Namespace) -> int:
    rows = optimizer_rows()
    if args.format == "json":
        print(json.dumps(rows, indent=2))
        return 0
    # --fields adds the config fields, one per line; the description wraps first, then the rest.
    width = output_width()
    if args.fields:
        table = [
            (r["name"], r["source"], r["shapes"], "\n".join(f"{k}={v}" for k, v in r["fields"].items()), r["description"])
            for r in rows
        ]
        text = fit_table(table, OPTIMIZER_HEADERS, width, wrap=[4, 3, 2, 1, 0], tablefmt="simple_grid", cut_words=False)
        if widest_line(text) > width:  # five columns cannot share a narrow terminal: two go under each row
            table = [(*row[:3], row[3].replace("\n", ", "), row[4]) for row in table]
            text = fit_table(table, OPTIMIZER_HEADERS, width, wrap=[2, 1, 0], details=[4, 3])
        print(text)
    else:
        narrow = [(r["name"], r["source"], r["shapes"], r["description"]) for r in rows]
        headers = [h for h in OPTIMIZER_HEADERS if h != "config fields (defaults)"]
        print(fit_table(narrow, headers, width, wrap=[3, 2, 1, 0], tablefmt="simple_grid"))
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    if args.to is not None or args.source != "optzoo" or args.config is not None:
        return _convert_recipe(args)
    recipes = shipped_recipes()
    if args.format == "json":
        print(json.dumps([{"name": name, "description": text} for name, text in recipes.items()], indent=2))
        return 0
    print(fit_table(list(recipes.items()), ["recipe", "description"], output_width(), wrap=[1]))
    return 0


def _convert_recipe(args: argparse.Namespace) -> int:
    """``recipes --config FILE [--from megatron-yaml] --to FORMAT``: one recipe in another shape."""
    from optzoo.config_file import dump_recipe, recipe_from_overrides
    from optzoo.recipe_formats import MegatronNames, dump_megatron_yaml, megatron_from_overrides, parse_megatron_yaml, torchtitan_param_groups

    if args.config is None:
        raise ValueError(f"`--config`: the recipe to convert is missing; got --to {args.to} without it; "
                         "expected --config FILE (or a shipped recipe's name)")  # fmt: skip
    names: MegatronNames | None = None
    overrides: Mapping[ParamKey, OverrideValue] | None
    if args.source == "megatron-yaml":
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as error:
            raise ValueError(f"`--config`: cannot be read; got {args.config!r}: {error.strerror or error}; expected a YAML file") from None
        config, overrides, names = parse_megatron_yaml(text, where=args.config)
    else:
        config, overrides = load_config_file(args.config)
    to = args.to or "toml"
    if to == "toml" or to == "yaml":
        print(dump_recipe(recipe_from_overrides(overrides, config), "toml" if to == "toml" else "yaml"), end="")
    elif to == "megatron-yaml":
        print(dump_megatron_yaml(megatron_from_overrides(config, overrides, names)), end="")
    else:
        if args.model is None:
            raise ValueError("`--model`: torchtitan's param groups are checked on the model; got no --model; expected e.g. --model gpt")
        with _current_directory_importable():
            model = build_model(args.model)
        if isinstance(model, list):
            raise ValueError(f"`--model`: torchtitan routes each model part alone; got {len(model)} chunks; expected one module")
        print(json.dumps(torchtitan_param_groups(config, overrides, model), indent=2))
    return 0


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
        _warn(f"`--distributed-mode {args.distributed_mode}` overrides the config's {flag}=True; "
              f"showing the {args.distributed_mode} plan")  # fmt: skip
    mode: Mode = args.distributed_mode
    return mode


LINT_EXIT_STATUS = 3
"""Exit status of ``optzoo lint`` (and ``dump-param-groups --lint``) under ``--strict`` when it finds something."""


@contextlib.contextmanager
def _current_directory_importable() -> Iterator[None]:
    """The current directory first on the import path while ``--model package.module:callable``
    is built, as ``python -m`` has it (the ``optzoo`` script has its own folder there instead).
    Only this entry point does it, and it puts the path back as it found it."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _resolve(args: argparse.Namespace) -> tuple[OptimizerConfig, list[ResolvedGroup], Routing, list[torch.nn.Module]]:
    """The config file (or the default config) and the model of ``args``, routed (and its chunks); warnings to stderr."""
    if args.config:
        config, overrides = load_config_file(args.config)
    else:
        config, overrides = OptimizerConfig(lr=DEFAULT_LR), None
    with _current_directory_importable():
        model = build_model(args.model)
    chunks = model if isinstance(model, list) else [model]
    dtype = getattr(args, "params_dtype", None)
    if dtype is not None:  # estimate --params-dtype: the model as it will be trained (bf16 params under bf16=True)
        import torch

        chunks = [chunk.to(getattr(torch, dtype)) for chunk in chunks]
    if not named_trainable_parameters(chunks):
        raise ValueError(f"`--model`: no trainable parameters; got {args.model!r}; expected a model with at least one")
    example = parse_example_inputs(args.example_inputs) if args.example_inputs else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups, routing = resolve_group_configs(
            config, chunks, overrides, strict=args.strict, example_inputs=example, trace=not args.no_trace
        )
    for warning in caught:
        _warn(warning.message)
    check_param_dtypes(config, groups)  # what get_optimizer would refuse, refused here too
    return config, groups, routing, chunks


def _lint_status(findings: list[Finding], args: argparse.Namespace) -> int:
    return LINT_EXIT_STATUS if findings and args.strict else 0


def _cmd_lint(args: argparse.Namespace) -> int:
    _, groups, routing, _ = _resolve(args)
    findings = lint_routing(groups, routing)
    if args.format == "json":
        print(json.dumps(findings_as_json(findings), indent=2))
    else:
        for finding in findings:
            print(wrap_lines(f"lint: {finding.kind}: {finding.message}", output_width()))
        print(f"{len(findings)} finding{'' if len(findings) == 1 else 's'}")
    return _lint_status(findings, args)


def _check_world_size(args: argparse.Namespace) -> None:
    if args.world_size is not None and not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"`--world-size`: out of range; got {show_value(args.world_size)}; expected an integer in [1, {MAX_WORLD_SIZE}]")
    if args.distributed_mode is not None and args.world_size is None:
        raise ValueError(
            f"`--distributed-mode`: needs --world-size; got --distributed-mode {args.distributed_mode} "
            "without it; expected --world-size N as well"
        )


def _cmd_dump(args: argparse.Namespace) -> int:
    _check_world_size(args)
    if args.expert_world_size is not None and (
        args.world_size is None or args.expert_world_size < 1 or args.world_size % args.expert_world_size
    ):
        raise ValueError(
            f"`--expert-world-size`: must divide --world-size (expert-parallel x expert-data-parallel = data-parallel); "
            f"got {args.expert_world_size} with --world-size {args.world_size}; expected a divisor of N >= 1"
        )
    mesh = _mesh_arguments(args)
    config, groups, routing, chunks = _resolve(args)
    findings = lint_routing(groups, routing) if args.lint else []
    mesh_plans: list[MeshPlan] | None = None
    if mesh is not None:
        own = model_tp_plan(chunks)
        tp_plan = parse_tp_plan(args.tp_plan) if args.tp_plan is not None else own or DEFAULT_TP_PLAN
        plan_source = "--tp-plan" if args.tp_plan is not None else "the model's base_model_tp_plan" if own else "the default"
        mesh_plans = plan_mesh(
            groups, mesh, tp_plan=tp_plan, tp_mode=args.tp_mode, bucket_size=args.bucket_size,
            fsdp_orthogonalize=args.fsdp_orthogonalize,
        )  # fmt: skip
        for one in mesh_plans:
            one.tp_plan_source = plan_source
        if args.tp_plan is not None and mesh_plans and mesh_plans[0].unmatched_rules:
            _warn(f"`--tp-plan`: rules match no Muon-family param: {', '.join(mesh_plans[0].unmatched_rules)}")
    # The plans every rank of get_optimizer would compute: they need only shapes, so meta is enough.
    plan = expert_plan = None
    if args.world_size is not None:
        mode = _distributed_mode(args, config)
        if args.expert_world_size is None:
            plan = plan_shards(groups, args.world_size, mode)
        else:
            experts = {name for g in groups for routed, name in zip(g.params, g.param_names) if is_expert(routed)}
            dense = {name for g in groups for name in g.param_names} - experts
            plan = plan_shards(groups, args.world_size, mode, names=dense)
            expert_plan = plan_shards(groups, args.expert_world_size, mode, names=experts)
    owners = {} if plan is None else owner_shards(groups, plan)
    if expert_plan is not None:
        owners.update({name: shards for name, shards in owner_shards(groups, expert_plan).items() if shards})
    if args.format == "json":
        document = param_group_map(groups, routing)
        if not args.explain:
            document.pop("matched_rules")
            document.pop("roles")
        for group in document["groups"]:
            group.pop("config")
        if plan is not None:
            document["world_size"] = plan.world_size
            document["distributed_mode"] = plan.mode
            document["owners"] = {
                name: [{"rank": s.rank, "start": s.start, "stop": s.stop} for s in shards] for name, shards in owners.items()
            }
            document["ranks"] = rank_rows(plan)
        if expert_plan is not None:
            document["expert_world_size"] = expert_plan.world_size
            document["expert_ranks"] = rank_rows(expert_plan)
        if mesh_plans is not None:
            document["owner_compute"] = [one.as_json() for one in mesh_plans]
            document["owner_compute_gathered"] = gathered_params(groups)
        if args.explain and (kernels := newton_schulz_rows(groups)):
            document["newton_schulz"] = [dict(zip(NEWTON_SCHULZ_HEADERS, row, strict=True)) for row in kernels]
        if args.lint:
            document["lint"] = findings_as_json(findings)
        print(json.dumps(document, indent=2))
        return _lint_status(findings, args)
    width = output_width()
    overrides = GROUP_HEADERS.index("other overrides")
    print(fit_table(group_rows(groups), GROUP_HEADERS, width, details=[overrides]))
    if args.explain or plan is not None:
        rows, headers = explain_rows(groups, routing), EXPLAIN_HEADERS
        if not args.explain:
            rows, headers = [row[:3] for row in rows], headers[:3]
        if plan is not None:
            label = "owner (experts: expert-DP rank)" if expert_plan is not None else "owner"
            rows, headers = [[*row, owner_text(owners[row[0]])] for row in rows], [*headers, label]
        # Too wide: rules, roles and matrices go under their row; owners, then names, wrap.
        details = [headers.index(h) for h in ("matched rules", "role", "matrices") if h in headers]
        wrap = [len(headers) - 1, 0] if plan is not None else [0]
        print()
        print(fit_table(rows, headers, width, wrap=wrap, details=details))
    if args.explain and (kernels := newton_schulz_rows(groups)):
        print()
        print(fit_table(kernels, NEWTON_SCHULZ_HEADERS, width, wrap=[3]))
    for one_plan, what in ((plan, " (non-expert params)" if expert_plan else ""), (expert_plan, " (expert params)")):
        if one_plan is None:
            continue
        table = [[r["rank"], r["params"], r["state_elements"], format_gflop(r["load_flops"]), 100 * r["share"]] for r in rank_rows(one_plan)]
        group = "expert data-parallel rank" if one_plan is expert_plan else "rank"
        print()
        print(f"{one_plan.mode} plan over {one_plan.world_size} {group}{'s' if one_plan.world_size > 1 else ''}{what}:")
        print(tabulate(table, headers=RANK_HEADERS, tablefmt="simple", floatfmt=".1f", disable_numparse=[3], colalign=("right",) * 5))
    if mesh_plans is not None:
        print()
        assert mesh is not None  # planned only with --mesh
        print(owner_compute_text(mesh_plans, mesh, width, gathered_params(groups)))
    if args.lint:
        print()
        for finding in findings:
            print(wrap_lines(f"lint: {finding.kind}: {finding.message}", width))
        print(f"{len(findings)} lint finding{'' if len(findings) == 1 else 's'}")
    return _lint_status(findings, args)


def _cmd_estimate(args: argparse.Namespace) -> int:
    if args.mesh is not None and args.distributed_mode is not None:
        raise ValueError(
            f"`--distributed-mode`: plans the layer-wise or ZeRO-1 optimizer, which refuse FSDP2 params; got --distributed-mode "
            f"{args.distributed_mode} with --mesh {args.mesh}; expected one of them"
        )
    _check_world_size(args)
    mesh = _mesh_arguments(args)
    config, groups, _, chunks = _resolve(args)
    world_size = args.world_size or 1
    mode: Distributed | None = None
    if mesh is None and world_size > 1:
        flagged = args.distributed_mode is not None or config.use_layer_wise_distributed_optimizer or config.use_distributed_optimizer
        mode = _distributed_mode(args, config) if flagged else "none"
    tp_plan = parse_tp_plan(args.tp_plan) if args.tp_plan is not None else model_tp_plan(chunks) or DEFAULT_TP_PLAN
    result = estimate_groups(
        config, groups, world_size=world_size if mesh is None or args.world_size is not None else 1, distributed=mode,
        mesh=mesh, tp_plan=tp_plan, tp_mode=args.tp_mode, bucket_size=args.bucket_size,
        fsdp_orthogonalize=args.fsdp_orthogonalize,
    )  # fmt: skip
    if args.format == "json":
        print(json.dumps(result.as_json(), indent=2))
        return 0
    width = output_width()
    print(fit_table(estimate_group_rows(result), ESTIMATE_GROUP_HEADERS, width))
    rows, headers = estimate_rank_table(result)
    details = [headers.index(h) for h in ("model grads", "Newton-Schulz", "largest bucket", "param sync") if h in headers]
    print()
    print(fit_table(rows, headers, width, details=details))
    print()
    print(wrap_lines(estimate_summary(result), width))
    return 0


_MESH_FLAGS = ("tp", "tp_plan", "tp_mode", "bucket_size", "fsdp_orthogonalize")


def _mesh_arguments(args: argparse.Namespace) -> MeshSpec | None:
    """``--mesh`` (with ``--tp``) parsed, after checking that the flags that refine it come with it."""
    if args.mesh is None:
        given = [name for name in _MESH_FLAGS if getattr(args, name) is not None]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"`{flag}`: needs --mesh; got {flag} without it; expected --mesh SPEC as well (e.g. --mesh 2x2)")
        return None
    if args.bucket_size is not None:
        args.bucket_size = parse_bytes(args.bucket_size)
    mesh = parse_mesh(args.mesh, args.tp)
    if args.tp_plan is not None and "tp" not in dict(mesh.dims):
        raise ValueError(
            f"`--tp-plan`: needs a tensor-parallel mesh dim; got --tp-plan with --mesh {args.mesh!r}; "
            "expected --tp T, or tp=T in --mesh"
        )
    return mesh


def _cmd_demo(args: argparse.Namespace) -> int:
    from optzoo.demo import run_demo

    run_demo(steps=args.steps)
    return 0


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True,
        help=f"built-in model ({', '.join(sorted(BUILTIN_MODELS))}), hf:ConfigClass or hf:path/config.json "
        "(a tiny Hugging Face model), or package.module:callable; built on the meta device",
    )  # fmt: skip
    parser.add_argument("--config", help=f"TOML or Python file, or a shipped recipe's name, with config and overrides (default: lr={DEFAULT_LR}, standard overrides)")
    parser.add_argument(
        "--example-inputs", metavar="SPEC",
        help="inputs of one forward, from which roles are read: comma-separated [name=]SHAPE[:dtype], e.g. "
        "'input_ids=1x16:int64' or '2x3x32x32' (positional); only shapes and dtypes matter "
        "(default: made from the model: Hugging Face configs, or a module's first layer)",
    )  # fmt: skip
    parser.add_argument(
        "--no-trace", action="store_true",
        help="guess roles from module types and names instead of observing one forward",
    )


def _distributed_arguments(parser: argparse.ArgumentParser, *, world_size_help: str, mode_default: str, mesh_help: str) -> None:
    """``--world-size`` and the flags that plan the distributed optimizers and FSDP2's mesh (``dump-param-groups``, ``estimate``)."""
    parser.add_argument("--world-size", type=int, metavar="N", help=world_size_help)
    parser.add_argument(
        "--distributed-mode", choices=["layer_wise", "sharded"],
        help=f"the plan with --world-size (default: the config's flag, as get_optimizer picks: layer_wise if it sets use_layer_wise_distributed_optimizer, else sharded if use_distributed_optimizer, else {mode_default})",
    )
    parser.add_argument(
        "--mesh", metavar="SPEC",
        help=f"{mesh_help} on this device mesh: N (FSDP over N ranks), RxS (HSDP: R replicas of an S-way shard) or "
        "named sizes such as dp=2,tp=2 or replicate=2,shard=2,tp=2",
    )  # fmt: skip
    parser.add_argument("--tp", type=int, metavar="T", help="with --mesh: add a tensor-parallel dim of T ranks (--mesh 2x2 --tp 2)")
    parser.add_argument(
        "--tp-plan", metavar="RULES",
        help="with --mesh: which params tensor parallelism shards, as comma-separated GLOB=STYLE rules (STYLE "
        "colwise, rowwise or replicate; first match wins; a glob matches the param's module path or a tail of it), "
        "replacing a Hugging Face model's own base_model_tp_plan, else the default (Megatron-Core's "
        "linear_qkv/linear_fc1 colwise, linear_proj/linear_fc2 rowwise; q/k/v/gate/up_proj, wq/wk/wv/w1/w3 colwise; "
        "o_proj/down_proj/wo/w2 rowwise); others are replicated over TP",
    )  # fmt: skip
    parser.add_argument(
        "--tp-mode", choices=list(get_args(TPMode)), metavar="MODE",
        help=f"with --mesh: how a tensor-parallel matrix is orthogonalised: {', '.join(get_args(TPMode))} "
        "(default: the config's muon_tp_mode)",
    )
    parser.add_argument(
        "--bucket-size", metavar="BYTES",
        help="with --mesh: the cap on each rank's transient bytes per bucket, e.g. 64MiB (default: the config's muon_bucket_size)",
    )
    parser.add_argument(
        "--fsdp-orthogonalize", choices=["auto", "owner", "redundant"],
        help="with --mesh: owner-computes or every rank (default: the config's muon_fsdp_orthogonalize)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="optzoo", description="A zoo of PyTorch optimizers with parameter-group routing.")
    parser.add_argument("--version", action="version", version=_version(), help="show optzoo's version (and torch's) and exit")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    listing = commands.add_parser("list", help="the registered optimizers and the config fields they read")
    listing.add_argument("--format", choices=["table", "json"], default="table")
    listing.add_argument("--fields", action="store_true", help="also show the config fields each optimizer reads, with defaults")
    listing.set_defaults(run=_cmd_list)

    recipes = commands.add_parser("recipes", help="the recipes shipped with optzoo, for --config NAME; or one recipe in another project's shape")
    recipes.add_argument("--format", choices=["table", "json"], default="table", help="of the list of shipped recipes")
    recipes.add_argument("--config", help="the recipe to convert: a TOML/YAML/Python file or a shipped recipe's name (a Megatron YAML file with --from megatron-yaml)")
    recipes.add_argument(
        "--from", dest="source", choices=["optzoo", "megatron-yaml"], default="optzoo",
        help="the shape of --config: optzoo's recipe (default) or Megatron-LM's overrides_config YAML",
    )  # fmt: skip
    recipes.add_argument(
        "--to", choices=["toml", "yaml", "megatron-yaml", "torchtitan"],
        help="write --config as optzoo TOML (default) or YAML, Megatron-LM's overrides_config YAML, or torchtitan's param_groups (JSON, needs --model)",
    )  # fmt: skip
    recipes.add_argument("--model", help="with --to torchtitan: the model the param groups are checked on (as dump-param-groups --model)")
    recipes.set_defaults(run=_cmd_recipes)

    dump = commands.add_parser("dump-param-groups", help="show how a model's parameters are grouped")
    _model_arguments(dump)
    dump.add_argument("--explain", action="store_true", help="add one row per parameter: its roles and the rules that matched it")
    dump.add_argument("--format", choices=["table", "json"], default="table")
    dump.add_argument(
        "--strict", action="store_true",
        help=f"a rule that matches nothing is an error; with --lint, a finding exits with status {LINT_EXIT_STATUS}",
    )
    dump.add_argument("--lint", action="store_true", help="also run the routing linter (what `optzoo lint` prints)")
    _distributed_arguments(
        dump, world_size_help="also show the distributed optimizer's plan over N ranks: each param's owner and each rank's load",
        mode_default="layer_wise", mesh_help="also show Muon's FSDP2 owner-computes plan (per bucket who orthogonalises each "
        "Muon-family matrix, and each rank's bytes sent and received, transient bytes and Newton-Schulz FLOPs)",
    )  # fmt: skip
    dump.add_argument(
        "--expert-world-size", type=int, metavar="M",
        help="with --world-size N: expert params (allreduce=False, or the expert role) get their own plan over an "
        "expert data-parallel group of M ranks (M divides N), as get_optimizer(expert_process_group=...) plans them",
    )
    dump.set_defaults(run=_cmd_dump)

    estimate = commands.add_parser(
        "estimate", help="the optimizer's memory per group, algorithm and rank, and its Newton-Schulz FLOPs, before launch"
    )
    _model_arguments(estimate)
    estimate.add_argument("--format", choices=["table", "json"], default="table")
    estimate.add_argument("--strict", action="store_true", help="a rule that matches nothing is an error")
    estimate.add_argument(
        "--params-dtype", choices=["float32", "bfloat16", "float16"],
        help="cast the model's params to this dtype first, as it will be trained (bf16=True steps float32 copies of "
        "bfloat16 params; float32 params are their own main params); default: as the model is built",
    )  # fmt: skip
    _distributed_arguments(
        estimate, world_size_help="bytes and FLOPs per rank of a data-parallel group of N ranks",
        mode_default="layer_wise if it sets use_layer_wise_distributed_optimizer, else every rank steps everything (DDP)",
        mesh_help="FSDP2: each rank's shards, and the transient bytes per bucket of Muon's owner-computes plan,",
    )  # fmt: skip
    estimate.set_defaults(run=_cmd_estimate)

    lint = commands.add_parser("lint", help="routings that run but look wrong: embeddings on Muon, decayed norms, ...")
    _model_arguments(lint)
    lint.add_argument("--format", choices=["table", "json"], default="table")
    lint.add_argument(
        "--strict", action="store_true",
        help=f"a rule that matches nothing is an error, and a finding exits with status {LINT_EXIT_STATUS}",
    )
    lint.set_defaults(run=_cmd_lint)

    demo = commands.add_parser("demo", help="train the built-in GPT on the standard library's source")
    demo.add_argument("--steps", type=_positive_int, default=120)
    demo.set_defaults(run=_cmd_demo)

    return parser


def parse_example_inputs(spec: str) -> tuple[object, ...] | dict[str, object]:
    """``--example-inputs``: ``[name=]SHAPE[:dtype]`` entries, comma-separated, as meta tensors.

    Positional entries give a tuple of inputs, named ones a dict; not both.

    Example:
        >>> {k: (tuple(v.shape), v.dtype) for k, v in parse_example_inputs("input_ids=1x16:int64").items()}
        {'input_ids': ((1, 16), torch.int64)}
        >>> [tuple(t.shape) for t in parse_example_inputs("2x3x32x32")]
        [(2, 3, 32, 32)]
    """
    import torch

    positional: list[object] = []
    named: dict[str, object] = {}
    for entry in (part.strip() for part in spec.split(",")):
        name, _, rest = entry.rpartition("=")
        shape_text, _, dtype_name = rest.partition(":")
        try:
            shape = tuple(int(size) for size in shape_text.lower().split("x")) if shape_text else ()
        except ValueError:
            raise ValueError(
                f"`--example-inputs`: not a shape; got {entry!r}; expected [name=]SHAPE[:dtype] such as input_ids=1x16:int64"
            ) from None
        dtype = getattr(torch, dtype_name or "float32", None)
        if not isinstance(dtype, torch.dtype) or any(size < 0 for size in shape):
            raise ValueError(
                f"`--example-inputs`: bad dtype or size; got {entry!r}; expected a torch dtype name (float32, int64, "
                "bfloat16, ...) and sizes >= 0"
            )
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        if name:
            named[name] = tensor
        else:
            positional.append(tensor)
    if positional and named:
        raise ValueError(f"`--example-inputs`: mixes positional and named inputs; got {spec!r}; expected one kind")
    return named if named else tuple(positional)


MAX_WORLD_SIZE = 1 << 20
"""The largest ``--world-size`` planned (a plan holds a list per rank)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``optzoo`` script; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
        return status
    except BrokenPipeError:  # `optzoo list | head`: the reader left; no error message, as cat does
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # silence the flush at exit
        except (OSError, ValueError, AttributeError):
            pass
        return 0
    except (ValueError, TypeError, KeyError, ImportError, OSError, tomllib.TOMLDecodeError) as error:
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if isinstance(error, ImportError) and not message.startswith("`"):
            message = f"`--model`: cannot import; got {message}"
        print(_for_stderr(f"optzoo: error: {message}"), file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
