"""A census of roles and routing over every model class ``transformers`` ships.

Run: ``.venv/bin/python -m benchmarks.routing_census [--workers 2] [--json census.json]`` (about 5
minutes for ~1,570 classes on 2 idle cores), or ``--match Bert`` / ``--limit 50`` for a part. Each
class is built tiny on the meta device (``optzoo.hf.build_hf_model``: the first of ever less tiny
configs whose forward runs), untagged, as a new user would build it, and routed with
``OptimizerConfig(optimizer="muon")`` and the standard overrides. For each it records:

* its status: ``not built`` (transformers could not build it: a missing extra such as ``timm``,
  a config that needs a value, over the time limit); ``traced`` (every parameter's roles come
  from the forward); ``partly traced`` (the forward ran but did not reach some parameters, say a
  vision tower whose image input could not be made: theirs are guessed); ``fell back`` (the
  forward could not run: every role guessed, with ``trace_uses``'s reason); ``crashed`` (optzoo
  raised, hung or killed its process: a bug, kept with its traceback);
* how many trainable parameters hold each role, and how many go to Muon and to the scalar optimizer;
* the linter's findings under this default routing: every one is a false alarm;
* the seconds it took to build and to route.

``MODELS`` names a handful of models for the tests that step each of them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import itertools
import json
import logging
import multiprocessing
import re
import signal
import threading
import time
import traceback
import typing
import warnings
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

TIME_LIMIT_S = 60
"""Seconds one model may take to build, and again to route (some configs build hundreds of layers)."""
HANG_S = 2 * TIME_LIMIT_S
"""Seconds a worker may stay silent in one phase before it is killed: the alarm cannot interrupt C code."""
PER_PROCESS = 100
"""Models per worker process before a fresh one takes over: each model imports its modeling module,
and a process that has imported hundreds of them holds gigabytes."""
MUON: dict[str, Any] = {"optimizer": "muon", "lr": 1e-3, "weight_decay": 0.1}
STATUSES = ("traced", "partly traced", "fell back", "not built", "crashed")
REASON_CHARS = 80
"""Reasons are counted together when their first this many characters agree (numbers aside)."""


def _hf(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from optzoo.hf import build_hf_model

        return build_hf_model(name)

    return build


def _nanogpt() -> nn.Module:
    """nanoGPT's layout and forward: ``wte`` tied to ``lm_head``, learned ``wpe``, pre-norm blocks."""

    class Block(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
            self.attn = nn.ModuleDict({"c_attn": nn.Linear(hidden, 3 * hidden), "c_proj": nn.Linear(hidden, hidden)})
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(hidden, 4 * hidden), "c_proj": nn.Linear(4 * hidden, hidden)})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.attn["c_attn"](self.ln_1(x)).chunk(3, dim=-1)
            x = x + self.attn["c_proj"](nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            return x + self.mlp["c_proj"](nn.functional.gelu(self.mlp["c_fc"](self.ln_2(x))))

    class NanoGPT(nn.Module):
        def __init__(self, hidden: int = 64, vocab: int = 256) -> None:
            super().__init__()
            self.transformer = nn.ModuleDict({
                "wte": nn.Embedding(vocab, hidden), "wpe": nn.Embedding(128, hidden),
                "h": nn.ModuleList(Block(hidden) for _ in range(2)), "ln_f": nn.LayerNorm(hidden),
            })  # fmt: skip
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.lm_head.weight = self.transformer["wte"].weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.transformer["wte"](ids) + self.transformer["wpe"](torch.arange(ids.shape[1], device=ids.device))
            for block in self.transformer["h"]:
                x = block(x)
            return self.lm_head(self.transformer["ln_f"](x))  # type: ignore[no-any-return]

    return NanoGPT()


def _builtin_gpt() -> nn.Module:
    from optzoo.models import GPT, GPTConfig

    return GPT(GPTConfig())


MODELS: dict[str, Callable[[], nn.Module]] = {
    "Llama": _hf("LlamaConfig"),
    "Mixtral": _hf("MixtralConfig"),
    "Qwen3-MoE": _hf("Qwen3MoeConfig"),
    "Qwen2-MoE": _hf("Qwen2MoeConfig"),
    "GPT-OSS": _hf("GptOssConfig"),
    "DeepSeek-V3": _hf("DeepseekV3Config"),
    "GPT-2 (tied)": _hf("GPT2Config"),
    "nanoGPT (plain module, tied)": _nanogpt,
    "ResNet (conv)": _hf("ResNetForImageClassification"),
    "built-in GPT (Megatron-tagged)": _builtin_gpt,
}
"""Models the integration tests step with Muon (tests/integrations/test_real_models.py)."""


def model_classes() -> list[str]:
    """Every model class named in ``transformers``' auto mappings that ``transformers`` exports, sorted."""
    transformers = importlib.import_module("transformers")
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    names: set[str] = set()
    for mapping in (getattr(auto, n) for n in dir(auto) if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")):
        for value in mapping.values():
            names.update(value if isinstance(value, (list, tuple)) else [value])
    return sorted(name for name in names if hasattr(transformers, name))


# --- one model --------------------------------------------------------------------------------


class _TimeUp(BaseException):
    """The alarm. A BaseException, so that the ``except Exception`` around a traced forward (a
    failed forward is an answer there) cannot swallow it and run on without a limit."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _TimeUp


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals: no limit
        yield
        return
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _routing_dir() -> Path:
    return Path(importlib.import_module("optzoo.routing").__file__ or "").resolve().parent


def _raised_in_routing(error: BaseException) -> bool:
    """Whether ``error`` came out of optzoo's routing package (``trace_uses`` promises ``None`` instead)."""
    routing = _routing_dir()
    return any(Path(frame.f_code.co_filename).resolve().is_relative_to(routing) for frame, _ in traceback.walk_tb(error.__traceback__))


def _where(tb: TracebackType | None) -> str:
    """The innermost frame of a traceback, ``file:line in function``, to say where a time limit struck."""
    frames = traceback.extract_tb(tb)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


def _line(error: BaseException) -> str:
    """``Type: message`` on one line (a wrapped error's message can start with a newline), cut to 300 chars."""
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def census_one(name: str, progress: Callable[[str], None] = lambda phase: None) -> dict[str, Any]:
    """One class's row (see the module docstring); ``progress`` hears ``"build"`` and ``"route"`` as each begins."""
    from optzoo import OptimizerConfig, lint_routing, resolve_group_configs
    from optzoo.hf import build_hf_model
    from optzoo.routing import trace_uses

    row: dict[str, Any] = {"model": name, "status": "", "reason": "", "roles": {}, "params": 0, "guessed": 0,
                           "muon": 0, "scalar": 0, "lint": [], "build_s": 0.0, "route_s": 0.0}  # fmt: skip
    progress("build")
    start = time.perf_counter()
    try:
        with _time_limit(TIME_LIMIT_S), torch.device("meta"):
            model = build_hf_model(name)
    except _TimeUp as error:
        row.update(status="not built", reason=f"over {TIME_LIMIT_S} s building (at {_where(error.__traceback__)})")
        return row
    except Exception as error:
        if _raised_in_routing(error):  # the builder's trial forward: routing code that should not raise
            row.update(status="crashed", reason=f"while building: {_line(error)}", traceback=traceback.format_exc())
        else:  # transformers' own failure (or a config it refuses): not optzoo's
            row.update(status="not built", reason=_line(error))
        return row
    finally:
        row["build_s"] = round(time.perf_counter() - start, 3)
    progress("route")
    start = time.perf_counter()
    try:
        with _time_limit(TIME_LIMIT_S):
            groups, routing = resolve_group_configs(OptimizerConfig(**MUON), model)
            findings = lint_routing(groups, routing)
            routed = [r for g in groups for r in g.params]
            unreached = [r.name for r in routed if r.roles.guessed]
            fell_back = bool(routed) and len(unreached) == len(routed)
            why = trace_uses(model)[1] if fell_back else ""  # a second forward, only where the first failed
    except _TimeUp as error:
        row.update(status="crashed", reason=f"routing took over {TIME_LIMIT_S} s (at {_where(error.__traceback__)})",
                   traceback="".join(traceback.format_tb(error.__traceback__)))  # fmt: skip
        return row
    except Exception as error:  # optzoo's routing raised on a model that builds: a bug to report
        row.update(status="crashed", reason=_line(error), traceback=traceback.format_exc())
        return row
    finally:
        row["route_s"] = round(time.perf_counter() - start, 3)
    row.update(
        status="fell back" if fell_back else "partly traced" if unreached else "traced",
        reason=why or _unreached([r.name for r in routed], unreached),
        roles=dict(sorted(collections.Counter(role for r in routed for role in r.roles.roles).items())),
        params=len(routed),
        guessed=len(unreached),
        muon=sum(len(g.params) for g in groups if g.optimizer == "muon"),
        lint=[{"kind": f.kind, "params": list(f.params)[:5], "message": f.message[:500]} for f in findings],
    )
    row["scalar"] = len(routed) - row["muon"]
    if unreached and not fell_back:
        row["unreached"] = unreached[:20]
    return row


def _unreached(names: Sequence[str], unreached: Sequence[str]) -> str:
    """Where the forward did not go: the widest module none of whose params it reached, the one
    holding the most unreached params (layer numbers as N, so a layer's siblings count together)."""
    if not unreached:
        return ""
    total, missed = collections.Counter[str](), collections.Counter[str]()
    for counter, of in ((total, names), (missed, unreached)):
        for name in of:
            parts = name.split(".")
            counter.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    roots = collections.Counter[str]()
    for name in unreached:
        parts = name.split(".")
        root = next(p for p in (".".join(parts[:k]) for k in range(1, len(parts) + 1)) if total[p] == missed[p])
        roots[re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "N", root)] += 1
    where, most = roots.most_common(1)[0]
    elsewhere = f"; {len(unreached) - most} elsewhere" if most < len(unreached) else ""
    return f"not reached: {where} ({most} of {len(names)} params{elsewhere})"


# --- many models ------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No Python warnings and no logging (transformers' included) inside, as before outside.

    Guessed roles are counted as statuses, lint findings as rows: the warnings would only repeat them.
    """
    transformers = importlib.import_module("transformers")
    verbosity, disabled = transformers.logging.get_verbosity(), logging.root.manager.disable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        logging.disable(logging.CRITICAL)
        try:
            yield
        finally:
            logging.disable(disabled)
            transformers.logging.set_verbosity(verbosity)


def census(names: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of ``names``, in this process, in order."""
    with _quiet():
        return [census_one(name) for name in names]


def _worker(names: list[str], conn: Connection) -> None:
    """A subprocess's loop: ``("phase", name, phase)`` as each phase begins, ``("row", row)`` after each model."""
    with _quiet():
        for name in names:

            def progress(phase: str, name: str = name) -> None:
                conn.send(("phase", name, phase))

            conn.send(("row", census_one(name, progress)))
    conn.close()


def _lost(name: str, phase: str, why: str) -> dict[str, Any]:
    """The row of a model whose process died or hung: a build that never returns is transformers', a route optzoo's."""
    status = "not built" if phase == "build" else "crashed"
    doing = {"build": "building", "route": "routing"}.get(phase, "starting")
    return {"model": name, "status": status, "reason": f"{why} while {doing}",
            "roles": {}, "params": 0, "guessed": 0, "muon": 0, "scalar": 0, "lint": [], "build_s": 0.0, "route_s": 0.0}  # fmt: skip


def _run_workers(names: Sequence[str], workers: int, echo: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """``census`` over interleaved slices in ``workers`` spawned subprocesses.

    A process that dies (a segfault, an abort) or stays silent past :data:`HANG_S` loses only the
    model it was on: that model gets a row saying so, and a fresh process takes the rest of its slice.
    """
    context = multiprocessing.get_context("spawn")  # no fork: torch's threads and transformers' locks
    todo = [collections.deque(names[k::workers]) for k in range(workers)]
    rows: list[dict[str, Any]] = []
    # Per live worker: its process, its queue of names, and (model, phase, since) of what it is on.
    live: dict[Connection, tuple[Any, collections.deque[str], list[Any]]] = {}

    def start(queue: collections.deque[str]) -> None:
        batch = list(itertools.islice(queue, PER_PROCESS))  # names leave the queue as their rows come back
        if not batch:
            return
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_worker, args=(batch, send), daemon=True)
        process.start()
        send.close()  # the child holds the only writer: its exit is our EOF
        live[receive] = (process, queue, [None, "", time.monotonic()])

    def finish(conn: Connection, why: str | None) -> None:
        process, queue, (model, phase, _) = live.pop(conn)
        if why is not None:
            process.kill()
        process.join()
        if why is None and process.exitcode != 0:
            why = f"its process died (exit code {process.exitcode})"
        if why is not None:  # before its first model, it is charged the next one: no endless restarts
            rows.append(_lost(model or queue[0], phase or "start", why))
            echo(f"{rows[-1]['model']}: {rows[-1]['status']}: {rows[-1]['reason']}")
            queue.popleft()
        start(queue)

    for queue in todo:
        start(queue)
    while live:
        for ready in wait(list(live), timeout=5):
            conn = typing.cast(Connection, ready)  # wait() gives back what it was given
            try:
                message = conn.recv()
            except EOFError:
                finish(conn, None)
                continue
            _, queue, now = live[conn]
            if message[0] == "phase":
                now[:] = [message[1], message[2], time.monotonic()]
            else:
                rows.append(message[1])
                queue.popleft()
                now[:] = [None, "", time.monotonic()]
                echo(f"[{len(rows)}/{len(names)}] {message[1]['model']}: {message[1]['status']}")
        for conn, (_, _, (model, _, since)) in list(live.items()):
            if model is not None and time.monotonic() - since > HANG_S:
                finish(conn, f"its process hung (no answer in {HANG_S} s; killed)")
    return sorted(rows, key=lambda row: row["model"])


# --- report -----------------------------------------------------------------------------------


def _reason_key(reason: str) -> str:
    """A reason without its inputs' shapes and numbers, cut to :data:`REASON_CHARS`, so like failures count together."""
    if match := re.match(r"ValueError: `hf:[^`]*`: the model does not build from its config; got (.*)", reason):
        reason = match[1]  # the builder's wrapper names the model: keep its cause
    if match := re.match(r"ImportError: \w+ requires the (\w+) library", reason):
        reason = f"ImportError: needs the {match[1]} library"  # one line for every class a missing extra stops
    elif match := re.match(r"\w+\.forward requires (`\w+`)", reason):
        reason = f"forward requires {match[1]}, which optzoo cannot make"  # the class aside
    elif reason.startswith("its forward failed on") and "): " in reason:
        reason = "forward failed: " + reason.split("): ", 1)[1]  # the error itself, not the made inputs' shapes
    elif reason.startswith("not reached: "):
        parts = reason.removeprefix("not reached: ").split(" (")[0].split(".")
        reason = "not reached: " + ".".join(parts[-2:] if parts[-1] == "N" else parts[-1:])  # wherever it sits
    return re.sub(r"\d+", "N", reason)[:REASON_CHARS]


def summary(rows: Sequence[dict[str, Any]], top: int = 15) -> str:
    """The totals, the params per role, the top reasons per status and every lint finding, as text."""
    count = collections.Counter(row["status"] for row in rows)
    built = len(rows) - count["not built"]
    totals = [len(rows), built, count["traced"], count["partly traced"], count["fell back"], count["crashed"], count["not built"],
              sum(len(row["lint"]) for row in rows)]  # fmt: skip
    headers = ["classes", "built", "traced", "partly traced", "fell back", "crashed", "not built", "lint findings"]
    lines = [tabulate([totals], headers=headers)]
    roles: collections.Counter[str] = collections.Counter()
    holders: collections.Counter[str] = collections.Counter()
    for row in rows:
        roles.update(row["roles"])
        holders.update(row["roles"].keys())
    routed = [row for row in rows if row["params"]]
    placed = [[sum(r[field] for r in routed) for field in ("params", "muon", "scalar", "guessed")]]
    lines += ["", "roles of the routed (trainable) params, over the built models:",
              tabulate([[role, n, holders[role]] for role, n in roles.most_common()], headers=["role", "params", "models"]),
              "", tabulate(placed, headers=["params routed", "on muon", "on scalar", "guessed"])]  # fmt: skip
    for status in ("not built", "fell back", "partly traced", "crashed"):
        of_status = [row for row in rows if row["status"] == status]
        groups = collections.defaultdict(list)
        for row in of_status:
            groups[_reason_key(row["reason"])].append(row["model"])
        if groups:
            ranked = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
            table = [[len(models), key, models[0]] for key, models in ranked[:top]]
            rest = sum(len(models) for _, models in ranked[top:])
            more = f" ({rest} more classes in {len(ranked) - top} other reasons)" if rest else ""
            headers = ["classes", f"reason (first {REASON_CHARS} chars, numbers as N)", "e.g."]
            lines += ["", f"{status} ({len(of_status)}): top reasons{more}", tabulate(table, headers=headers)]
    findings = [[row["model"], f["kind"], ", ".join(f["params"][:2]), f["message"][:120]] for row in rows for f in row["lint"]]
    if findings:
        kinds = collections.Counter(kind for _, kind, _, _ in findings)
        lines += ["", "lint findings under the default routing (false alarms)", tabulate(kinds.most_common(), headers=["kind", "findings"]),
                  "", tabulate(findings, headers=["model", "kind", "params", "message"])]  # fmt: skip
    slowest = sorted((row for row in rows if row["build_s"] or row["route_s"]), key=lambda r: -(r["build_s"] + r["route_s"]))[:5]
    lines += ["", "slowest: " + ", ".join(f"{r['model']} ({r['build_s']:.0f} s + {r['route_s']:.0f} s)" for r in slowest)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", help="only classes whose name contains this")
    parser.add_argument("--limit", type=int, help="only the first N classes (sorted by name)")
    parser.add_argument("--workers", type=int, default=1, help="subprocesses, each over an interleaved slice (default 1: in this process)")
    parser.add_argument("--json", metavar="PATH", help="write every row here")
    parser.add_argument("--progress", action="store_true", help="print a line per model as it is done (with --workers > 1)")
    args = parser.parse_args(argv)
    names = model_classes()
    if args.match:
        names = [n for n in names if args.match in n]
    names = names[: args.limit] if args.limit else names
    start = time.perf_counter()
    if args.workers > 1:
        rows = _run_workers(names, args.workers, (lambda line: print(line, flush=True)) if args.progress else lambda line: None)
    else:
        rows = census(names)
    print(f"transformers {importlib.import_module('transformers').__version__}, torch {torch.__version__}: "
          f"{len(names)} classes in {time.perf_counter() - start:.0f} s on {args.workers} worker(s)\n")  # fmt: skip
    print(summary(rows))
    crashed = [row for row in rows if row["status"] == "crashed"]
    for row in crashed:  # each is an optzoo bug: its traceback, whole
        print(f"\n--- crashed: {row['model']}: {row['reason']}\n{row.get('traceback', '(no traceback: the process died)')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
