"""Hugging Face ``transformers`` models: build tiny ones offline, for tests, examples and the CLI.

A Hugging Face model needs no tags for optzoo's routing: roles (:mod:`optzoo.routing.roles`) are
read from the model itself, its ``get_input_embeddings()`` and ``get_output_embeddings()``, its
module types (``nn.Embedding``, ``LlamaRMSNorm``, ``Qwen3MoeExperts``, ``MixtralTopKRouter``) and
parameter names, so ``OptimizerConfig(optimizer="muon")`` with the standard overrides gives the
usual Muon split: embeddings and the head (tied or not), norms, biases and vectors to
``muon_scalar_optimizer``; attention and MLP matrices, routers and expert stacks to Muon.
:func:`tag_hf_model`, which set Megatron's tags by hand before roles existed, is deprecated.

GPT-2's ``Conv1D`` stores weights as in × out, the transpose of ``nn.Linear``. Newton–Schulz
commutes with transposition and the default ``muon_scale_mode="spectral"`` (√max(rows, cols)) is
symmetric, so Muon's update is exactly the transpose of the one for the equivalent ``nn.Linear``;
``shape_scaling`` and ``unit_rms_norm`` read the stored shape, so they give the factor of the
transposed layer. GPT-2's fused ``c_attn`` is not split into Q, K and V: Muon splits rows, in
Megatron's per-group interleaved layout, while ``c_attn`` holds Q, K and V side by side in its
*columns*; a row split would cut the input dimension. It is orthogonalised whole.
"""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

__all__ = [
    "TINY_SHAPE",
    "build_hf_model",
    "load_hf_config",
    "tag_hf_model",
]

TINY_SHAPE: dict[str, int] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
}
"""The sizes :func:`build_hf_model` gives a config class, for the fields it has (through its
``attribute_map``: GPT-2's ``n_embd`` is ``hidden_size``) and that its defaults set (not
``None``). Byte-level vocabulary, so examples can train on raw bytes; 4 heads of 16 with 2 KV
heads exercise grouped-query attention; 2 layers show the per-layer pattern; mixture-of-experts
configs (Qwen2/3-MoE, Mixtral, GPT-OSS, DeepSeek) get 4 experts of 32 (2 per token)."""

_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _transformers() -> ModuleType:
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(
            f"`transformers`: needed for Hugging Face models; got {error}; "
            "expected `pip install transformers` (it is in optzoo's `test` extra)"
        ) from error


def _weight(module: Any, where: str) -> nn.Parameter:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        raise TypeError(
            f"`{where}`: has no weight parameter; got {type(module).__name__}; "
            "expected a module with a `weight` nn.Parameter (nn.Embedding, nn.Linear)"
        )
    return weight


def tag_hf_model(model: nn.Module) -> dict[str, str]:
    """Deprecated: set Megatron's routing tags on a Hugging Face model by hand, in place.

    optzoo now reads what each parameter is from the model (:mod:`optzoo.routing.roles`), so
    tagging is not needed. A model tagged this way still routes as before: its tags name the
    input and output embeddings (``is_embedding_or_output_parameter``) and every other
    ``nn.Embedding`` weight gets ``use_muon=False`` (a ``use_muon`` already set is kept).

    Returns:
        ``{param name: tag}`` for every param that now carries one, in model order.

    Raises:
        TypeError: ``model`` has no ``get_input_embeddings``, or an embedding has no weight.

    Warns:
        DeprecationWarning: always.
    """
    warnings.warn(
        "`optzoo.hf.tag_hf_model`: deprecated (optzoo reads embeddings, the head, norms, experts and routers "
        "from the model); drop the call, and see `optzoo dump-param-groups --explain` for each parameter's role",
        DeprecationWarning,
        stacklevel=2,
    )
    get_input = getattr(model, "get_input_embeddings", None)
    if not callable(get_input):
        raise TypeError(
            f"`model`: not a Hugging Face model; got {type(model).__name__} without get_input_embeddings(); "
            "expected a transformers PreTrainedModel"
        )
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    ends = [_weight(get_input(), "get_input_embeddings()")]
    if output is not None:
        ends.append(_weight(output, "get_output_embeddings()"))
    for end in ends:
        end.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]
    for module in model.modules():
        table = module.weight if isinstance(module, nn.Embedding) else None
        # An explicit use_muon the user already set is theirs: keep it.
        if table is not None and not any(table is end for end in ends) and not hasattr(table, "use_muon"):
            table.use_muon = False  # type: ignore[attr-defined]
    tags: dict[str, str] = {}
    for name, param in model.named_parameters():  # tied tensors appear once, under their first name
        if getattr(param, "is_embedding_or_output_parameter", False):
            tags[name] = "is_embedding_or_output_parameter"
        elif getattr(param, "use_muon", True) is False:
            tags[name] = "use_muon=False"
    return tags


def _tiny_kwargs(config_class: Any) -> dict[str, Any]:
    """:data:`TINY_SHAPE` restricted to the fields ``config_class`` has, plus in-vocab special tokens."""
    defaults = config_class()
    kwargs: dict[str, Any] = {
        field: value for field, value in TINY_SHAPE.items() if getattr(defaults, field, None) is not None
    }
    vocab = kwargs.get("vocab_size", getattr(defaults, "vocab_size", None))
    for field in _SPECIAL_TOKENS:
        # GPT-2's 50256 is outside a 256-token vocabulary: unset it rather than log a warning
        # (and index past the embedding in generation).
        token = getattr(defaults, field, None)
        ids = token if isinstance(token, list) else [token]
        if vocab is not None and any(isinstance(i, int) and i >= vocab for i in ids):
            kwargs[field] = None
    return kwargs


def load_hf_config(spec: str) -> Any:
    """A ``transformers`` config from a config class name (tiny sizes) or a local ``config.json``.

    Args:
        spec: A config class exported by ``transformers`` (``"LlamaConfig"``, ``"GPT2Config"``),
            built with :data:`TINY_SHAPE`; or a path to a ``config.json`` file, or to a folder
            holding one, used as is. A path contains ``/`` or ends in ``.json``.

    Returns:
        A ``transformers.PreTrainedConfig``. Nothing is downloaded: a path is read with
        :mod:`json` and handed to ``AutoConfig.for_model``.

    Raises:
        ImportError: ``transformers`` is not installed.
        FileNotFoundError: The path does not exist.
        ValueError: Not a config class name, or the JSON has no ``model_type``.
    """
    transformers = _transformers()
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    if "/" in spec or spec.endswith(".json"):
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"`hf:{spec}`: no such config file; got {str(path)!r}; expected a path to a config.json")
        values = json.loads(path.read_text())
        model_type = values.pop("model_type", None) if isinstance(values, dict) else None
        if not isinstance(model_type, str):
            raise ValueError(
                f"`hf:{spec}`: config.json has no model_type; got {model_type!r}; "
                "expected a Hugging Face config.json, e.g. with \"model_type\": \"llama\""
            )
        return transformers.AutoConfig.for_model(model_type, **values)
    config_class = getattr(transformers, spec, None) if spec.isidentifier() else None
    if not (isinstance(config_class, type) and issubclass(config_class, base)):
        raise ValueError(
            f"`hf:{spec}`: not a transformers config class; got {spec!r}; expected a class name such as "
            "LlamaConfig or GPT2Config, or a path to a config.json"
        )
    return config_class(**_tiny_kwargs(config_class))


def build_hf_model(spec: str) -> nn.Module:
    """A randomly initialised causal LM: ``AutoModelForCausalLM.from_config`` of :func:`load_hf_config`.

    Builds on the current default device, so ``with torch.device("meta"):`` gives shapes without
    memory (what ``optzoo dump-param-groups --model hf:LlamaConfig`` does). Seed torch first
    for a reproducible init.

    Args:
        spec: See :func:`load_hf_config` (without the ``hf:`` prefix of ``--model``).

    Returns:
        The model, untouched: optzoo reads its roles from it.

    Raises:
        ImportError: ``transformers`` is not installed.
        FileNotFoundError, ValueError: See :func:`load_hf_config`; ``ValueError`` also when
            ``transformers`` has no causal LM for the config.

    Example:
        >>> model = build_hf_model("LlamaConfig")
        >>> [(name, tuple(p.shape)) for name, p in model.named_parameters()][:3]
        [('model.embed_tokens.weight', (256, 64)), ('model.layers.0.self_attn.q_proj.weight', (64, 64)), ('model.layers.0.self_attn.k_proj.weight', (32, 64))]
    """
    config = load_hf_config(spec)
    try:
        model = _transformers().AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise  # a bad value in the config itself: transformers' message says which
        raise ValueError(
            f"`hf:{spec}`: AutoModelForCausalLM has no model for this config; got {type(config).__name__}; "
            "expected a decoder config such as LlamaConfig or GPT2Config"
        ) from error
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers always returns modules
        raise TypeError(f"`hf:{spec}`: from_config returned {type(model).__name__}; expected a torch.nn.Module")
    return model

