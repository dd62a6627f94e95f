"""A census of roles and routing over every model class ``transformers`` ships.

Run: ``.venv/bin/python -m benchmarks.routing_census [--workers 2] [--json census.json]`` (about
10 minutes on 2 cores), or ``--match Bert`` / ``--limit 50`` for a part. Each class is built tiny
on the meta device (``optzoo.hf.build_hf_model``: the first of ever less tiny configs whose
forward runs), untagged, as a new user would build it, and routed with
``OptimizerConfig(optimizer="muon")`` and the standard overrides. For each it records:

* its status: ``not built`` (transformers could not build it: a missing extra such as ``timm``,
  a config that needs a value); ``traced`` (every parameter's roles come from the forward);
  ``partly traced`` (the forward ran but did not reach some parameters, say a vision tower whose
  image tokens the made input lacks: theirs are guessed); ``fell back`` (the forward could not
  run: every role guessed, with the reason); ``crashed`` (optzoo's routing raised: a bug);
* how many parameters hold each role, and how many go to Muon and to the scalar optimizer;
* the linter's findings under this default routing: every one is a false alarm.

``MODELS`` names a handful of models for the tests that step each of them.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import logging
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

TIME_LIMIT_S = 60
"""Seconds one model may take to build and route (some configs build hundreds of layers)."""
MUON = {"optimizer": "muon", "lr": 1e-3, "weight_decay": 0.1}


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


class _TimeUp(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _TimeUp


def census_one(name: str) -> dict[str, Any]:
    """One class's row (see the module docstring)."""
    from optzoo import OptimizerConfig, lint_routing, resolve_group_configs
    from optzoo.hf import build_hf_model

    row: dict[str, Any] = {"model": name, "status": "", "reason": "", "roles": {}, "muon": 0, "scalar": 0, "lint": []}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    start = time.perf_counter()
    try:
        try:
            with torch.device("meta"):
                model = build_hf_model(name)
        except (_TimeUp, Exception) as error:  # transformers' own failure: not optzoo's
            row.update(status="not built", reason=_line(error))
            return row
        row["build_s"] = time.perf_counter() - start
        start = time.perf_counter()
        try:
            groups, routing = resolve_group_configs(OptimizerConfig(**MUON), model)
            findings = lint_routing(groups, routing)
        except _TimeUp as error:
            row.update(status="crashed", reason=f"over {TIME_LIMIT_S} s: {_line(error)}")
            return row
        except Exception as error:  # optzoo's routing raised: a bug to report
            row.update(status="crashed", reason=_line(error))
            return row
        row["route_s"] = time.perf_counter() - start
    finally:
        signal.alarm(0)
    routed = [r for g in groups for r in g.params]
    guessed = sum(r.roles.guessed for r in routed)
    row["status"] = "traced" if not guessed else "fell back" if guessed == len(routed) else "partly traced"
    if guessed:
        from optzoo.routing import trace_uses

        if guessed == len(routed):
            row["reason"] = trace_uses(model)[1]
        else:  # where the forward did not go: the module most of the unreached params sit in
            where = collections.Counter(".".join(r.name.split(".")[:2]) for r in routed if r.roles.guessed).most_common(1)[0][0]
            row["reason"] = f"not reached: {where}.* ({guessed} of {len(routed)} params)"
    row["roles"] = dict(collections.Counter(role for r in routed for role in r.roles.roles))
    row["muon"] = sum(len(g.params) for g in groups if g.optimizer == "muon")
    row["scalar"] = len(routed) - row["muon"]
    row["lint"] = [{"kind": f.kind, "params": list(f.params)[:3], "message": f.message[:300]} for f in findings]
    return row


def _line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _quiet() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.CRITICAL)
    try:
        importlib.import_module("transformers").logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - transformers is in the test extra
        pass


def census(names: Sequence[str]) -> list[dict[str, Any]]:
    """The rows of ``names``, in this process."""
    _quiet()
    return [census_one(name) for name in names]


def _run_workers(names: Sequence[str], workers: int) -> list[dict[str, Any]]:
    """``census`` over interleaved slices in ``workers`` subprocesses: one that dies loses its slice, not the run."""
    slices = [list(names[k::workers]) for k in range(workers)]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.routing_census", "--worker", json.dumps(part)], stdout=subprocess.PIPE, text=True
        )
        for part in slices
    ]
    rows: list[dict[str, Any]] = []
    for part, process in zip(slices, processes):
        out, _ = process.communicate()
        done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        rows += done
        seen = {row["model"] for row in done}
        rows += [{"model": n, "status": "crashed", "reason": f"worker exited {process.returncode}", "roles": {}, "lint": []}
                 for n in part if n not in seen]  # fmt: skip
    return sorted(rows, key=lambda row: row["model"])


STATUSES = ("traced", "partly traced", "fell back", "not built", "crashed")


def summary(rows: Sequence[dict[str, Any]]) -> str:
    """The totals, the role counts, the top reasons per status and every lint finding, as text."""
    count = collections.Counter(row["status"] for row in rows)
    built = len(rows) - count["not built"]
    lines = [tabulate(
        [[len(rows), built, *(count[s] for s in STATUSES if s != "not built"), count["not built"],
          sum(len(row["lint"]) for row in rows)]],
        headers=["classes", "built", "traced", "partly traced", "fell back", "crashed", "not built", "lint findings"],
    )]  # fmt: skip
    roles: collections.Counter[str] = collections.Counter()
    for row in rows:
        roles.update(row["roles"])
    lines += ["", "params per role (built models): " + ", ".join(f"{role} {n:,}" for role, n in sorted(roles.items()))]
    for status in ("partly traced", "fell back", "not built", "crashed"):
        reasons = collections.Counter(_reason_class(row["reason"]) for row in rows if row["status"] == status)
        if reasons:
            lines += ["", f"{status}: top reasons", tabulate(reasons.most_common(12), headers=["reason", "classes"])]
    findings = [(row["model"], f["kind"], f["message"][:160]) for row in rows for f in row["lint"]]
    if findings:
        lines += ["", "lint findings under the default routing (false alarms)", tabulate(findings, headers=["model", "kind", "message"])]
    return "\n".join(lines)


def _reason_class(reason: str) -> str:
    """A reason without its counts and shapes, so that like failures count together."""
    if reason.startswith("not reached: "):
        return reason.split(" (")[0]
    if "): " in reason and reason.startswith("its forward failed"):
        reason = reason.split("): ", 1)[1]  # the error itself, without the inputs' shapes
    return reason[:100]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", help="only classes whose name contains this")
    parser.add_argument("--limit", type=int, help="only the first N classes (sorted by name)")
    parser.add_argument("--workers", type=int, default=1, help="subprocesses, each over an interleaved slice (default 1)")
    parser.add_argument("--json", metavar="PATH", help="write every row here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a JSON list of names: print one JSON row per line
    args = parser.parse_args(argv)
    if args.worker is not None:
        _quiet()
        for name in json.loads(args.worker):
            print(json.dumps(census_one(name)), flush=True)
        return
    names = model_classes()
    if args.match:
        names = [n for n in names if args.match in n]
    names = names[: args.limit] if args.limit else names
    start = time.perf_counter()
    rows = _run_workers(names, args.workers) if args.workers > 1 else census(names)
    print(f"transformers {importlib.import_module('transformers').__version__}, torch {torch.__version__}, "
          f"{len(names)} classes in {time.perf_counter() - start:.0f} s")  # fmt: skip
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
