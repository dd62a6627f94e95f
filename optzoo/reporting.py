"""What routing decided, as table rows and JSON: used by the CLI, the demo and ``get_optimizer``'s dumps.

Nothing here changes anything; every function reads resolved groups (and a sharding plan) and
returns plain rows or dicts, so ``optzoo dump-param-groups`` and a script print the same facts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from tabulate import tabulate

from optzoo._common import MatrixView, jsonable
from optzoo.config import OptimizerConfig
from optzoo.distributed.plan import Shard, ShardingPlan
from optzoo.groups import ResolvedGroup
from optzoo.mesh_plan import MeshPlan, MeshSpec, format_bytes, param_name, unit_label, unit_mode
from optzoo.optimizers.newton_schulz_probe import VARIANT_ENV, allowed_kernels, disk_choice, probe_key
from optzoo.optimizers.registry import get_spec, registered_names
from optzoo.routing import Routing

if TYPE_CHECKING:
    from optzoo.estimate import MemoryEstimate

__all__ = [
    "EXPLAIN_HEADERS",
    "GROUP_HEADERS",
    "NEWTON_SCHULZ_HEADERS",
    "OPTIMIZER_HEADERS",
    "RANK_HEADERS",
    "DEFAULT_WIDTH",
    "ESTIMATE_GROUP_HEADERS",
    "estimate_group_rows",
    "estimate_rank_table",
    "estimate_summary",
    "explain_rows",
    "newton_schulz_rows",
    "fit_table",
    "format_gflop",
    "group_rows",
    "optimizer_rows",
    "owner_compute_text",
    "owner_shards",
    "output_width",
    "owner_text",
    "param_group_map",
    "rank_rows",
    "widest_line",
    "wrap_lines",
]

GROUP_HEADERS = ["group", "optimizer", "lr", "weight_decay", "other overrides", "params", "elements"]
RANK_HEADERS = ["rank", "params owned", "state elements", "load (GFLOP/step)", "share (%)"]
OPTIMIZER_HEADERS = ["name", "source", "shapes", "config fields (defaults)", "description"]


def optimizer_rows() -> list[dict[str, Any]]:
    """One row per registered optimizer: name, source, shapes, its config fields with defaults, description."""
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
                "fields": {f: jsonable(defaults[f]) for f in fields},
                "description": spec.description,
            }
        )
    return rows


def _format_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def group_rows(groups: Sequence[ResolvedGroup]) -> list[list[Any]]:
    """One row per group (:data:`GROUP_HEADERS`): index, optimizer, lr, weight decay, other overrides, counts."""
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


def _matched_rules(group: ResolvedGroup, matched: Sequence[int], routing: Routing) -> list[str]:
    # "(standard)": a standard override laid under the user's rules (theirs win field by field).
    reasons = [f"#{k} {routing.keys[k].describe()}{' (standard)' if k in routing.defaults else ''}" for k in matched]
    if group.auto_routed:
        reasons.append(group.auto_routed)
    return reasons


EXPLAIN_HEADERS = ["parameter", "group", "shape", "role", "matrices", "matched rules"]


def explain_rows(groups: Sequence[ResolvedGroup], routing: Routing) -> list[list[Any]]:
    """One row per parameter name (tied names included) (:data:`EXPLAIN_HEADERS`): name, group,
    shape, its roles with their sources, the matrices its optimizer steps it as (the blocks the
    forward multiplies by, out x in; ``-`` for element-wise optimizers), the rules that matched it."""
    rows: list[list[Any]] = []
    for group in groups:
        for routed, names in zip(group.params, group.all_names):
            reasons = "; ".join(_matched_rules(group, routed.matched, routing)) or "-"
            shape = "x".join(map(str, routed.param.shape)) or "scalar"
            matrices = _matrices(group, routed.param)
            rows.extend([name, group.index, shape, routed.roles.describe(), matrices, reasons] for name in names)
    return rows


NEWTON_SCHULZ_HEADERS = ["matrices", "count", "muon_fp32_matmul_prec", "Newton-Schulz kernel"]


def newton_schulz_rows(groups: Sequence[ResolvedGroup]) -> list[list[Any]]:
    """What Newton–Schulz kernel the Muon family's steps run, per matrix shape (as Muon batches
    them: shape, ``muon_fp32_matmul_prec``, steps) and why (:data:`NEWTON_SCHULZ_HEADERS`): pinned
    (``muon_ns_variant`` or ``OPTZOO_NS_VARIANT``), the rule, the disk cache's choice for a CPU
    run, or the kernels the first step will time."""
    counts: dict[tuple[int, int, str, int, str], int] = {}
    for group in groups:
        if get_spec(group.optimizer).family != "orthogonalized":
            continue
        config = group.config
        setting = config.muon_ns_variant or os.environ.get(VARIANT_ENV) or "probe"
        for routed in group.params:
            if routed.param.dim() < 2:
                continue
            view = group.matrix_view_of(routed.param) or MatrixView.default(tuple(routed.param.shape), flatten=group.flatten)
            key = (*view.shape, config.muon_fp32_matmul_prec, config.muon_num_ns_steps, setting)
            counts[key] = counts.get(key, 0) + view.count
    rows: list[list[Any]] = []
    for (rows_, cols, precision, steps, setting), count in counts.items():
        if setting == "auto":
            kernel = "auto: the FLOPs and device-type rule (pinned)"
        elif setting != "probe":
            kernel = f"{setting} (pinned)"
        else:
            example = torch.empty((count, rows_, cols), device="meta")
            cached = disk_choice(probe_key(example, steps=steps, matmul_precision=precision)._replace(device="cpu"))  # type: ignore[arg-type]
            kernels = allowed_kernels(precision, torch.float32, torch.device("cpu"), count, min(rows_, cols))  # type: ignore[arg-type]
            stacked = ", ".join(str(k) for k in kernels if k.stacked) + ("; stacked or per matrix" if count > 1 else "")
            kernel = f"{cached} (OPTZOO_NS_CACHE, on CPU)" if cached else f"probed at the first step: the fastest of {len(kernels)} on CPU ({stacked})"
        rows.append([f"{rows_}x{cols}", count, precision, kernel])
    return rows


def _matrices(group: ResolvedGroup, param: torch.Tensor) -> str:
    """The matrices a non-element-wise optimizer steps ``param`` as: the forward's view, else its default."""
    if get_spec(group.optimizer).elementwise or param.dim() < 2:
        return "-"
    view = group.matrix_view_of(param) or MatrixView.default(tuple(param.shape), flatten=group.flatten)
    return view.describe()


def param_group_map(groups: Sequence[ResolvedGroup], routing: Routing) -> dict[str, Any]:
    """``{"param_to_group": {name: index}, "matched_rules": {name: [rules]}, "roles": {name: {role:
    source}}, "groups": [summary...]}`` for every name (tied too): what ``dump_param_to_param_group_map``
    writes."""
    mapping: dict[str, int] = {}
    provenance: dict[str, list[str]] = {}
    roles: dict[str, dict[str, str]] = {}
    for group in groups:
        for routed, names in zip(group.params, group.all_names):
            for name in names:
                mapping[name] = group.index
                provenance[name] = _matched_rules(group, routed.matched, routing)
                roles[name] = dict(zip(routed.roles.roles, routed.roles.sources))
                if routed.roles.guessed:
                    roles[name]["guessed"] = "no forward use observed: module types, names and shapes"
    return {
        "param_to_group": mapping,
        "matched_rules": provenance,
        "roles": roles,
        "groups": [group.summary() for group in groups],
    }


def owner_text(shards: Sequence[Shard]) -> str:
    """``1`` for a param one rank owns whole; ``0[0:44] 1[44:64]`` for one split into ranges."""
    if len(shards) == 1 and shards[0].whole:
        return str(shards[0].rank)
    return " ".join(f"{s.rank}[{s.start}:{s.stop}]" for s in shards)


def owner_shards(groups: Sequence[ResolvedGroup], plan: ShardingPlan) -> dict[str, list[Shard]]:
    """``{name: shards}`` for every parameter name, tied names included (they share the shards)."""
    by_canonical: dict[str, list[Shard]] = {}
    for shard in plan.shards:
        by_canonical.setdefault(shard.name, []).append(shard)
    return {
        name: by_canonical.get(canonical, [])
        for group in groups
        for canonical, names in zip(group.param_names, group.all_names)
        for name in names
    }


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


def format_gflop(flops: float) -> str:
    """GFLOP to 4 significant digits without an exponent (loads span 1e-3 to 1e4 GFLOP).

    Example:
        >>> format_gflop(1.234567e9), format_gflop(2.5e13), format_gflop(0.0)
        ('1.235', '25000', '0')
    """
    gflop = flops / 1e9
    return f"{gflop:.{max(0, 3 - math.floor(math.log10(gflop)))}f}" if gflop > 0 else "0"


DEFAULT_WIDTH = 80
"""Columns of output that goes to a pipe or file when ``COLUMNS`` is not set."""

DETAIL_INDENT = "    "
"""Indent of a cell moved out of a table onto its own line under the row (``fit_table``)."""


def output_width() -> int:
    """The columns the CLI's text must fit: ``COLUMNS`` when set to a positive integer (as
    ``shutil.get_terminal_size`` reads it), else the width of the terminal stdout is, else
    :data:`DEFAULT_WIDTH` (a pipe or a file)."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        if sys.stdout.isatty():
            return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError, AttributeError):  # a closed or replaced stdout
        pass
    return DEFAULT_WIDTH


def wrap_lines(text: str, width: int, indent: str = DETAIL_INDENT) -> str:
    """Each line of ``text`` wrapped at spaces to ``width`` columns, its continuations indented.

    Example:
        >>> print(wrap_lines("lint: kind: a message that is long", 16))
        lint: kind: a
            message that
            is long
    """
    return "\n".join(
        textwrap.fill(line, width, subsequent_indent=indent, break_on_hyphens=False) if len(line) > width else line
        for line in text.splitlines()
    )


_BREAK_AFTER = re.compile(r"(?<=[ .,;/-])")
"""Where a cell may wrap: after a space or a hyphen, or after the dot of a dotted parameter name."""

CONTINUATION = "  "
"""Indent of a wrapped cell's later lines in a borderless table, so they do not read as new rows."""


def _wrap_cell(text: str, width: int, indent: str = "") -> str:
    """``text`` in lines of at most ``width``, broken after spaces, hyphens and dots (a longer piece
    is cut); lines after the first of each paragraph start with ``indent``."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for piece in _BREAK_AFTER.split(paragraph):
            if len(line) + len(piece.rstrip()) <= width:
                line += piece
                continue
            if line.strip():
                lines.append(line.rstrip())
                line = indent
            while len(line) + len(piece.rstrip()) > width:
                cut = max(width - len(line), 1)
                lines.append(line + piece[:cut])
                line, piece = indent, piece[cut:]
            line += piece
        lines.append(line.rstrip())
    return "\n".join(lines)


def _longest_piece(text: str) -> int:
    return max((len(piece.rstrip()) for piece in _BREAK_AFTER.split(text.replace("\n", " "))), default=0)


def _widest(text: str) -> int:
    return max((len(line) for line in text.splitlines()), default=0)


def widest_line(text: str) -> int:
    """The length of the longest line of ``text``."""
    return _widest(text)


def _cell_width(value: Any) -> int:
    return max((len(line) for line in str(value).split("\n")), default=0)


def fit_table(
    rows: Sequence[Sequence[Any]],
    headers: Sequence[str],
    width: int,
    *,
    wrap: Sequence[int] = (),
    details: Sequence[int] = (),
    tablefmt: str = "simple",
    cut_words: bool = True,
    **options: Any,
) -> str:
    """``tabulate(rows, headers)``, made to fit ``width`` columns only where it would not.

    First the columns in ``details`` (indices, in that order) leave the table one by one, until it
    fits: their values go on lines of their own under the row, ``header: value``, indented and
    wrapped (``-`` and empty values are left out). Then the columns in ``wrap`` wrap inside their
    cells: each in turn (``wrap`` lists what gives way first) down to its longest word, then, if
    that is not enough, each in turn further, cutting words. Cells wrap at spaces, hyphens and the
    dots of parameter names; in the borderless format a cell's later lines are indented, so they
    do not read as new rows; ``cut_words=False`` stops before cutting words (the table may then not
    fit: the caller picks another layout). A table that fits is
    returned as ``tabulate`` prints it. ``details`` needs ``tablefmt="simple"``.

    Example:
        >>> print(fit_table([["decoder.layers.0.weight", 0, "a long explanation"]],
        ...                 ["parameter", "group", "why"], 30, wrap=[0], details=[2]))
        parameter            group
        -----------------  -------
        decoder.layers.0.        0
          weight
            why: a long explanation
    """
    if details and tablefmt != "simple":
        raise ValueError(f"`tablefmt`: details need the 'simple' format; got {tablefmt!r}; expected 'simple'")
    table = [list(row) for row in rows]
    text: str = tabulate(table, headers=list(headers), tablefmt=tablefmt, **options)
    if _widest(text) <= width:
        return text
    keep = list(range(len(headers)))
    moved: list[int] = []
    for column in details:
        moved.append(column)
        keep.remove(column)
        text = tabulate([[row[c] for c in keep] for row in table], headers=[headers[c] for c in keep], tablefmt=tablefmt, **options)
        if _widest(text) <= width:
            break
    wrapping = [keep.index(c) for c in wrap if c in keep]
    kept_headers = [headers[c] for c in keep]
    cells = [[row[c] for c in keep] for row in table]
    indent = CONTINUATION if tablefmt == "simple" else ""
    widths = {c: max([_cell_width(row[c]) for row in cells], default=0) for c in wrapping}
    whole_words = {c: max([len(kept_headers[c]), *(_longest_piece(str(row[c])) + len(indent) for row in cells)]) for c in wrapping}
    cut = {c: max(len(kept_headers[c]), 8) for c in wrapping}
    for floors in (whole_words, cut) if cut_words else (whole_words,):
        for _ in range(3):  # the estimate of what a column saves is exact but for header padding
            overflow = _widest(text) - width
            if overflow <= 0:
                break
            for c in wrapping:
                give = max(0, min(overflow, widths[c] - floors[c]))
                widths[c] -= give
                overflow -= give
            cells = [
                [_wrap_cell(str(value), widths[c], indent) if c in widths and _cell_width(value) > widths[c] else value for c, value in enumerate(row)]
                for row in ([row[c] for c in keep] for row in table)
            ]
            text = tabulate(cells, headers=kept_headers, tablefmt=tablefmt, **options)
    if not moved:
        return text
    lines = text.splitlines()
    head = max(len(h.split("\n")) for h in kept_headers) + 1
    out, at = lines[:head], head
    for row, full in zip(cells, table):
        height = max(len(str(value).split("\n")) for value in row)
        out.extend(lines[at : at + height])
        at += height
        for column in sorted(moved):
            value = str(full[column])
            if value not in ("", "-"):
                out.append(wrap_lines(f"{DETAIL_INDENT}{headers[column]}: {value}", width, DETAIL_INDENT * 2))
    return "\n".join(out)


# ---- the owner-computes plan (dump-param-groups --mesh) -----------------------------------------

MESH_RANK_HEADERS = ["rank", "sent", "received", "transient", "Newton-Schulz"]
MESH_TOTAL_HEADERS = ["rank", "sent", "received", "largest bucket", "Newton-Schulz", "vs 1 process"]


def _mib(size: float) -> str:
    """Bytes in the largest binary unit below them, 3 significant digits: ``512 B``, ``1.5 KiB``, ``5.38 MiB``.

    Example:
        >>> _mib(512), _mib(1536), _mib(1008 << 20)
        ('512 B', '1.5 KiB', '1008 MiB')
    """
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            value = size / scale  # 1000-1023 units: whole numbers, not 1.01e+03
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
    return f"{int(size)} B"


def _flop(flops: float) -> str:
    """FLOPs with an SI prefix, 4 significant digits: ``15.36 kFLOP``, ``234.9 MFLOP``."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if flops >= scale:
            return f"{flops / scale:.4g} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def owner_compute_text(plans: Sequence[MeshPlan], mesh: MeshSpec, width: int, gathered: Sequence[str]) -> str:
    """``dump-param-groups --mesh``'s text: per plan and bucket, who computes what and each rank's
    bytes and Newton–Schulz FLOPs, then per rank over all buckets; ``gathered`` are the params
    stepped through a forward's view (listed when nothing is left to plan)."""
    if not plans:
        text = f"owner-computes plan on {mesh.describe()}: no Muon-family params to plan"
        if gathered:
            text += f"; gathered whole on every rank (a forward's view, Muon's plain path): {', '.join(gathered)}"
        return wrap_lines(text, width)
    lines: list[str] = []
    for plan in plans:
        buckets, world = plan.plan.buckets, plan.plan.world_size
        matrices = sum(len(b.units) for b in buckets)
        how = plan.orthogonalize if plan.fsdp_orthogonalize == plan.orthogonalize else f"{plan.fsdp_orthogonalize} -> {plan.orthogonalize}"
        where = plan.mesh.describe()
        if plan.mesh != mesh:
            where += f", params tensor parallelism leaves alone, in each of the {mesh.size('tp')} TP ranks' groups"
        if lines:
            lines.append("")
        lines.append(wrap_lines(
            f"owner-computes plan of {plan.optimizer} on {where}: tp_mode {plan.tp_mode}, bucket_size {format_bytes(plan.bucket_size)}, "
            f"fsdp_orthogonalize {how}; {matrices} {plan.dtype} matri{'ces' if matrices != 1 else 'x'} in "
            f"{len(buckets)} bucket{'s' * (len(buckets) != 1)}", width,
        ))  # fmt: skip
        if "tp" in dict(mesh.dims) and plan.tp_plan_source:
            lines.append(wrap_lines(f"tensor-parallel plan: {plan.tp_plan_source}", width))
        if plan.gathered:
            lines.append(wrap_lines(f"gathered whole on every rank (a forward's view, Muon's plain path): {', '.join(plan.gathered)}", width))
        for index, bucket in enumerate(buckets):
            rows = [
                [unit_label(unit, plan.counts), f"{unit.rows}x{unit.cols}", plan.styles.get(param_name(unit), "replicate").replace("replicate", "-"),
                 unit_mode(unit, plan.orthogonalize),
                 "every rank" if len(set(unit.owners)) == world > 1 else " ".join(map(str, unit.owners))]
                for unit in bucket.units
            ]  # fmt: skip
            table = [[r, _mib(bucket.sent[r]), _mib(bucket.received[r]), _mib(bucket.transient[r]), _flop(bucket.flops[r])] for r in range(world)]
            lines += [
                "", f"bucket {index}:", fit_table(rows, ["matrix", "as", "TP", "how", "owners"], width, wrap=[4, 0]), "",
                tabulate(table, headers=MESH_RANK_HEADERS, tablefmt="simple", disable_numparse=True, colalign=("right",) * 5),
            ]  # fmt: skip
        totals = plan.rank_totals()
        table = [
            [t["rank"], _mib(t["sent"]), _mib(t["received"]), _mib(t["transient_max"]), _flop(t["flops"]), f"{t['vs_one_process']:.3f}"]
            for t in totals
        ]  # fmt: skip
        table.append(["all", _mib(sum(t["sent"] for t in totals)), _mib(sum(t["received"] for t in totals)), "",
                      _flop(sum(t["flops"] for t in totals)), f"{sum(plan.plan.loads) / plan.one_process_flops:.3f}"])  # fmt: skip
        lines += ["", f"per rank, all buckets ({plan.orthogonalize}):", tabulate(
            table, headers=MESH_TOTAL_HEADERS, tablefmt="simple", disable_numparse=True, colalign=("right",) * 6)]  # fmt: skip
        busiest = max(range(world), key=lambda r: (plan.plan.loads[r], -r))
        lines.append(wrap_lines(
            f"busiest rank {busiest}: {_flop(plan.plan.loads[busiest])} of Newton-Schulz, "
            f"{plan.busiest_vs_one_process:.3f} of one process's {_flop(plan.one_process_flops)}; "
            "two buckets are in flight, so up to twice the largest bucket's transient bytes", width,
        ))  # fmt: skip
    return "\n".join(lines)


def estimate_group_rows(result: MemoryEstimate) -> list[list[Any]]:
    """``optzoo estimate``'s rows per group: index, optimizer, params, elements, state bytes."""
    return [[g.index, g.optimizer, g.params, g.elements, _mib(g.state_bytes)] for g in result.groups]


ESTIMATE_GROUP_HEADERS = ["group", "optimizer", "params", "elements", "state"]


def estimate_rank_table(result: MemoryEstimate) -> tuple[list[list[Any]], list[str]]:
    """``optzoo estimate``'s rows per rank and their headers: state, main params, gradient buffers,
    param-sync buffers (layer-wise and ZeRO-1 only), what they hold together, the largest
    Newton–Schulz bucket (FSDP2 only), model grads and Newton–Schulz FLOPs per step."""
    columns: list[tuple[str, Any]] = [
        ("rank", lambda r: r.rank), ("state", lambda r: _mib(r.state_bytes)), ("main params", lambda r: _mib(r.main_param_bytes)),
        ("grad buffers", lambda r: _mib(r.grad_buffer_bytes)),
    ]  # fmt: skip
    if result.distributed in ("layer_wise", "sharded"):
        columns.append(("param sync", lambda r: _mib(r.param_sync_bytes)))
    columns.append(("held", lambda r: _mib(r.held_bytes)))
    if result.distributed == "fsdp2":
        columns.append(("largest bucket", lambda r: _mib(max(r.transient_bytes, default=0))))
    columns += [("model grads", lambda r: _mib(r.model_grad_bytes)), ("Newton-Schulz", lambda r: _flop(r.orthogonalize_flops))]
    return [[read(rank) for _, read in columns] for rank in result.ranks], [name for name, _ in columns]


def estimate_summary(result: MemoryEstimate) -> str:
    """``optzoo estimate``'s closing lines: the setting, state per algorithm, and what the columns mean."""
    if result.mesh is not None:
        where = f"FSDP2 on {result.mesh.describe()}"
    elif result.distributed == "none":
        where = "one process" if result.world_size == 1 else f"DDP over {result.world_size} ranks (each steps everything)"
    else:
        where = f"{'layer-wise' if result.distributed == 'layer_wise' else 'ZeRO-1'} over {result.world_size} ranks"
    algorithms = ", ".join(f"{name} {_mib(size)}" for name, size in result.algorithms().items())
    return (
        f"{result.precision}; {where}; state by algorithm (whole model): {algorithms}. held: kept between steps "
        "(state, main params, grad and param-sync buffers); largest bucket: transient, two in flight; model grads: "
        "backward's, not the optimizer's; Newton-Schulz: FLOPs per step (MOP: its SVD)."
    )
