"""Where Muon's default routing puts each model's parameters: a census, comparable across revisions.

Run: ``.venv/bin/python -m benchmarks.routing_census`` (this checkout), or with another checkout
first on ``PYTHONPATH`` to see how it routed (the script uses only what every revision has:
``OptimizerConfig``, the group resolver and ``optzoo.models``). Each model is built on the meta
device from its config class, tiny, untagged, as a new user would build it; the config is
``OptimizerConfig(optimizer="muon", lr=1e-3)`` with the default (standard) overrides. For each
model it prints the parameters (tensors) and elements on Muon and on the scalar optimizer,
and the names of the tensors whose placement looks wrong by the usual Muon rule (an embedding or
head on Muon; a matrix or expert stack off it).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

import torch
from tabulate import tabulate
from torch import nn

import optzoo
from optzoo import OptimizerConfig

TINY = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
}  # fmt: skip
"""optzoo.hf.TINY_SHAPE as this revision has it, repeated so that older revisions build the same models."""


def _causal_lm(config_class: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        transformers = importlib.import_module("transformers")
        cls = getattr(transformers, config_class)
        defaults = cls()
        kwargs: dict[str, Any] = {k: v for k, v in TINY.items() if getattr(defaults, k, None) is not None}
        for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(defaults, token, None)
            if isinstance(value, int) and value >= TINY["vocab_size"]:
                kwargs[token] = None
        model: nn.Module = transformers.AutoModelForCausalLM.from_config(cls(**kwargs))
        return model

    return build


def _resnet() -> nn.Module:
    transformers = importlib.import_module("transformers")
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    model: nn.Module = transformers.ResNetForImageClassification(config)
    return model


def _nanogpt() -> nn.Module:
    """nanoGPT's layout: ``transformer.wte`` tied to ``lm_head``, learned ``wpe``, LayerNorms, Linears."""
    hidden, vocab = 64, 256
    model = nn.Module()
    model.transformer = nn.ModuleDict({
        "wte": nn.Embedding(vocab, hidden), "wpe": nn.Embedding(128, hidden),
        "h": nn.ModuleList(nn.ModuleDict({
            "ln_1": nn.LayerNorm(hidden), "attn": nn.ModuleDict({"c_attn": nn.Linear(hidden, 3 * hidden), "c_proj": nn.Linear(hidden, hidden)}),
            "ln_2": nn.LayerNorm(hidden), "mlp": nn.ModuleDict({"c_fc": nn.Linear(hidden, 4 * hidden), "c_proj": nn.Linear(4 * hidden, hidden)}),
        }) for _ in range(2)),
        "ln_f": nn.LayerNorm(hidden),
    })  # fmt: skip
    model.lm_head = nn.Linear(hidden, vocab, bias=False)
    model.lm_head.weight = model.transformer["wte"].weight
    return model


def _builtin_gpt() -> nn.Module:
    from optzoo.models import GPT, GPTConfig

    return GPT(GPTConfig())


MODELS: dict[str, Callable[[], nn.Module]] = {
    "Llama": _causal_lm("LlamaConfig"),
    "Mixtral": _causal_lm("MixtralConfig"),
    "Qwen3-MoE": _causal_lm("Qwen3MoeConfig"),
    "Qwen2-MoE": _causal_lm("Qwen2MoeConfig"),
    "GPT-OSS": _causal_lm("GptOssConfig"),
    "DeepSeek-V3": _causal_lm("DeepseekV3Config"),
    "GPT-2 (tied)": _causal_lm("GPT2Config"),
    "nanoGPT (plain module, tied)": _nanogpt,
    "ResNet (conv)": _resnet,
    "built-in GPT (Megatron-tagged)": _builtin_gpt,
}


def _resolve(config: OptimizerConfig, model: nn.Module) -> list[Any]:
    resolve = getattr(optzoo, "resolve_group_configs", None) or getattr(optzoo, "resolve_groups")  # renamed in issue 12
    groups, _ = resolve(config, [model], None)
    return list(groups)


def _looks_wrong(name: str, param: torch.Tensor, on_muon: bool) -> bool:
    lowered = name.lower()
    end = any(part in lowered for part in ("embed_tokens.", "embeddings.", "wte.", "wpe.", "lm_head.", "classifier.", "output_layer."))
    bias_or_norm = lowered.endswith("bias") or "norm" in lowered or "ln_" in lowered
    if on_muon:
        return end or bias_or_norm or param.dim() < 2
    return not end and not bias_or_norm and param.dim() >= 2 and "sinks" not in lowered


def census() -> list[list[Any]]:
    """``[model, params on Muon, elements on Muon, params on the scalar optimizer, its elements, suspicious names]``."""
    config = OptimizerConfig(optimizer="muon", lr=1e-3)
    rows = []
    for label, build in MODELS.items():
        with torch.device("meta"):
            model = build()
        names = {id(p): n for n, p in model.named_parameters()}
        counts = {True: [0, 0], False: [0, 0]}
        suspicious = []
        for group in _resolve(config, model):
            on_muon = group.optimizer in ("muon", "adaptive_muon")
            for routed in group.params:
                counts[on_muon][0] += 1
                counts[on_muon][1] += routed.param.numel()
                if _looks_wrong(names[id(routed.param)], routed.param, on_muon):
                    suspicious.append(names[id(routed.param)])
        rows.append([label, *counts[True], *counts[False], len(suspicious), ", ".join(sorted(set(s.split(".")[-2] + "." + s.split(".")[-1] for s in suspicious))[:6]) or "-"])
    return rows


HEADERS = ["model", "Muon params", "Muon elements", "scalar params", "scalar elements", "suspicious", "e.g."]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(f"optzoo from {optzoo.__file__}")
    print(tabulate(census(), headers=HEADERS))


if __name__ == "__main__":
    main()
