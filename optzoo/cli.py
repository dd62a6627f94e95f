"""The ``optzoo`` command line: ``list``, ``recipes``, ``dump-param-groups``, ``lint`` and ``demo``.

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
from collections.abc import Iterator, Sequence
from typing import NoReturn

from tabulate import tabulate

from optzoo._common import did_you_mean, show_value
from optzoo.config import OptimizerConfig
from optzoo.config_file import load_config_file, shipped_recipes
from optzoo.distributed.plan import Mode, plan_shards
from optzoo.distributed.setup import is_expert
from optzoo.groups import ResolvedGroup, resolve_group_configs
from optzoo.lint import Finding, findings_as_json, lint_routing
from optzoo.models import BUILTIN_MODELS, build_model
from optzoo.reporting import (
    EXPLAIN_HEADERS,
    GROUP_HEADERS,
    OPTIMIZER_HEADERS,
    RANK_HEADERS,
    explain_rows,
    fit_table,
    format_gflop,
    group_rows,
    optimizer_rows,
    output_width,
    owner_shards,
    owner_text,
    param_group_map,
    rank_rows,
    widest_line,
    wrap_lines,
)
from optzoo.routing import Routing, named_trainable_parameters
from optzoo.wrapper.param_map import check_param_dtypes

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
    recipes = shipped_recipes()
    if args.format == "json":
        print(json.dumps([{"name": name, "description": text} for name, text in recipes.items()], indent=2))
        return 0
    print(fit_table(list(recipes.items()), ["recipe", "description"], output_width(), wrap=[1]))
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


def _resolve(args: argparse.Namespace) -> tuple[OptimizerConfig, list[ResolvedGroup], Routing]:
    """The config file (or the default config) and the model of ``args``, routed; warnings to stderr."""
    if args.config:
        config, overrides = load_config_file(args.config)
    else:
        config, overrides = OptimizerConfig(lr=DEFAULT_LR), None
    with _current_directory_importable():
        model = build_model(args.model)
    chunks = model if isinstance(model, list) else [model]
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
    return config, groups, routing


def _lint_status(findings: list[Finding], args: argparse.Namespace) -> int:
    return LINT_EXIT_STATUS if findings and args.strict else 0


def _cmd_lint(args: argparse.Namespace) -> int:
    _, groups, routing = _resolve(args)
    findings = lint_routing(groups, routing)
    if args.format == "json":
        print(json.dumps(findings_as_json(findings), indent=2))
    else:
        for finding in findings:
            print(wrap_lines(f"lint: {finding.kind}: {finding.message}", output_width()))
        print(f"{len(findings)} finding{'' if len(findings) == 1 else 's'}")
    return _lint_status(findings, args)


def _cmd_dump(args: argparse.Namespace) -> int:
    if args.world_size is not None and not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"`--world-size`: out of range; got {show_value(args.world_size)}; expected an integer in [1, {MAX_WORLD_SIZE}]")
    if args.distributed_mode is not None and args.world_size is None:
        raise ValueError(
            f"`--distributed-mode`: needs --world-size; got --distributed-mode {args.distributed_mode} "
            "without it; expected --world-size N as well"
        )
    if args.expert_world_size is not None and (
        args.world_size is None or args.expert_world_size < 1 or args.world_size % args.expert_world_size
    ):
        raise ValueError(
            f"`--expert-world-size`: must divide --world-size (expert-parallel x expert-data-parallel = data-parallel); "
            f"got {args.expert_world_size} with --world-size {args.world_size}; expected a divisor of N >= 1"
        )
    config, groups, routing = _resolve(args)
    findings = lint_routing(groups, routing) if args.lint else []
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
    for one_plan, what in ((plan, " (non-expert params)" if expert_plan else ""), (expert_plan, " (expert params)")):
        if one_plan is None:
            continue
        table = [[r["rank"], r["params"], r["state_elements"], format_gflop(r["load_flops"]), 100 * r["share"]] for r in rank_rows(one_plan)]
        group = "expert data-parallel rank" if one_plan is expert_plan else "rank"
        print()
        print(f"{one_plan.mode} plan over {one_plan.world_size} {group}{'s' if one_plan.world_size > 1 else ''}{what}:")
        print(tabulate(table, headers=RANK_HEADERS, tablefmt="simple", floatfmt=".1f", disable_numparse=[3], colalign=("right",) * 5))
    if args.lint:
        print()
        for finding in findings:
            print(wrap_lines(f"lint: {finding.kind}: {finding.message}", width))
        print(f"{len(findings)} lint finding{'' if len(findings) == 1 else 's'}")
    return _lint_status(findings, args)


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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="optzoo", description="A zoo of PyTorch optimizers with parameter-group routing.")
    parser.add_argument("--version", action="version", version=_version(), help="show optzoo's version (and torch's) and exit")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    listing = commands.add_parser("list", help="the registered optimizers and the config fields they read")
    listing.add_argument("--format", choices=["table", "json"], default="table")
    listing.add_argument("--fields", action="store_true", help="also show the config fields each optimizer reads, with defaults")
    listing.set_defaults(run=_cmd_list)

    recipes = commands.add_parser("recipes", help="the recipes shipped with optzoo, for --config NAME")
    recipes.add_argument("--format", choices=["table", "json"], default="table")
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
    dump.add_argument(
        "--world-size", type=int, metavar="N",
        help="also show the distributed optimizer's plan over N ranks: each param's owner and each rank's load",
    )
    dump.add_argument(
        "--expert-world-size", type=int, metavar="M",
        help="with --world-size N: expert params (allreduce=False, or the expert role) get their own plan over an "
        "expert data-parallel group of M ranks (M divides N), as get_optimizer(expert_process_group=...) plans them",
    )
    dump.add_argument(
        "--distributed-mode", choices=["layer_wise", "sharded"],
        help="the plan with --world-size (default: sharded if the config sets use_distributed_optimizer, else layer_wise)",
    )
    dump.set_defaults(run=_cmd_dump)

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
