"""Hugging Face ``transformers`` models: build tiny ones offline, for tests, examples and the CLI.

A Hugging Face model needs no tags for optzoo's routing: roles (:mod:`optzoo.routing.roles`) are
read from one forward of the model on meta stand-ins, with inputs made from its config, so
``OptimizerConfig(optimizer="muon")`` with the standard overrides gives the usual Muon split:
input tables and heads (tied or not, whatever their names), norms, biases and gains to
``muon_scalar_optimizer``; attention and MLP matrices, routers and expert stacks to Muon.
:func:`tag_hf_model`, which set Megatron's tags by hand before roles existed, is deprecated.

GPT-2's ``Conv1D`` stores weights as in × out, the transpose of ``nn.Linear``; its forward computes
``x @ w``, so the roles record reads ``w`` as one out × in matrix and Muon steps (and scales) it as
the equivalent ``nn.Linear``. GPT-2's fused ``c_attn`` is not split into Q, K and V: the forward
splits its *product*, not the weight, so it is one matrix, orthogonalised whole.
"""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Iterator

import torch
from torch import nn

from optzoo._common import did_you_mean

__all__ = [
    "AUTO_CLASSES",
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

AUTO_CLASSES: tuple[str, ...] = (
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModelForMaskedLM",
    "AutoModelForImageClassification",
    "AutoModel",
)
"""The ``transformers`` Auto classes a config is built with, in this order: the first whose
mapping (``MODEL_FOR_CAUSAL_LM_MAPPING``, ...) has the config class (a head, as training uses),
else the bare model; an encoder with both a causal and a masked LM (BERT: ``is_decoder=False``)
gets the masked LM, as its causal head warns without ``is_decoder``. ``hf:SPEC:AutoModelForX``
picks one."""


def _is_path(spec: str) -> bool:
    """A path, not a class name: it holds a path separator, ends in ``.json``, or exists."""
    separators = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    return any(sep in spec for sep in separators) or spec.endswith(".json") or os.path.exists(spec)


def _split_auto(spec: str) -> tuple[str, str | None]:
    """``("T5Config", "AutoModelForSeq2SeqLM")`` from ``"T5Config:AutoModelForSeq2SeqLM"``; no
    Auto class named: ``(spec, None)``. A path may hold ``:`` (``C:\\``): only a trailing
    ``:Auto...`` name is split off."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail.isidentifier() and tail.startswith("Auto"):
        return head, tail
    return spec, None


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
    """:data:`TINY_SHAPE` restricted to the fields ``config_class`` has, plus in-vocab token ids."""
    defaults = config_class()
    kwargs: dict[str, Any] = {field: value for field, value in TINY_SHAPE.items() if _read(defaults, field) is not None}
    vocab = kwargs.get("vocab_size", _read(defaults, "vocab_size"))
    experts = any(_read(defaults, field) for field in ("n_routed_experts", "num_experts", "num_local_experts"))
    if experts and hasattr(defaults, "num_experts_per_tok") and _read(defaults, "num_experts_per_tok") is None:
        kwargs["num_experts_per_tok"] = TINY_SHAPE["num_experts_per_tok"]  # DeepSeek-V2's default leaves top-k unset
    if vocab is None and _read(_read(defaults, "text_config"), "vocab_size") is not None:
        vocab = TINY_SHAPE["vocab_size"]  # a multimodal config: its text model gets the tiny vocabulary
    if isinstance(vocab, int):
        kwargs.update(_in_vocab_token_ids(defaults, vocab))
    return kwargs


def _read(config: Any, field: str) -> Any:
    """``getattr(config, field, None)``; ``None`` too where a config refuses a global read of a per-layer field."""
    try:
        return getattr(config, field, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _in_vocab_token_ids(defaults: Any, vocab: int) -> dict[str, Any]:
    """Token-id fields (``eos_token_id``, ``image_token_id``, ...) moved into a ``vocab``-sized vocabulary.

    GPT-2's 50256 is outside 256 tokens: each distinct id outside is given one of the top ids
    (equal ids stay equal, so GPT-2's bos, eos and pad stay one token), so models that look for
    them (CLIP's pooling at ``eos``, sequence classification's ``pad``) find them.
    """
    try:
        values = defaults.to_dict()
    except Exception:  # not a transformers config
        return {}
    fields = {k: v for k, v in values.items() if k.endswith(("_token_id", "_token_index", "_token_ids")) or k in _SPECIAL_TOKENS}
    outside = sorted({i for v in fields.values() for i in (v if isinstance(v, list) else [v]) if isinstance(i, int) and i >= vocab})
    moved = {old: vocab - 1 - k for k, old in enumerate(outside)}
    if len(moved) >= vocab:
        return {}
    result: dict[str, Any] = {}
    for field, value in fields.items():
        ids = value if isinstance(value, list) else [value]
        if any(isinstance(i, int) and i in moved for i in ids):
            new = [moved.get(i, i) if isinstance(i, int) else i for i in ids]
            result[field] = new if isinstance(value, list) else new[0]
    return result


_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers", "n_layer", "num_decoder_layers")
"""Depth fields a config may have; the second, gentler tier of :func:`_tiny_configs` sets only these (to 2)."""


def _tiny_configs(config_class: Any, base: type, spec: str | None = None) -> Iterator[Any]:
    """``config_class`` built ever less tiny: :data:`TINY_SHAPE` where it takes it (then without its
    grouped-query sizes), then only its depth at 2, then its defaults; its sub-configs (a vision
    tower, a text model) the same way.

    A class's own checks (sizes that must divide) or its model's (Whisper's decoder keeps 6 heads
    when ``num_attention_heads`` maps to the encoder's) refuse some tiny sizes: the caller takes
    the first config that builds what it needs.

    Raises:
        ValueError: ``config_class`` refuses its own defaults (given ``spec``, which the message
            names; a sub-config that does is left at its parent's default instead).
    """
    try:
        defaults = config_class()
    except Exception as error:
        if spec is None:
            return
        raise ValueError(
            f"`hf:{spec}`: {config_class.__name__} does not build from its own defaults, so optzoo has no config to "
            f"shrink; got {type(error).__name__}: {' '.join(str(error).split())}"
        ) from error
    sub_classes = {
        name: type(_read(defaults, name))
        for name in (getattr(config_class, "sub_configs", None) or {})
        if isinstance(_read(defaults, name), base)
    }
    depth = {field: _read(defaults, field) for field in _LAYER_COUNTS}
    tiny = _tiny_kwargs(config_class)
    repairs = {k: v for k, v in tiny.items() if k == "num_experts_per_tok" and _read(defaults, k) is None}
    tiers: list[dict[str, Any]] = [
        tiny,
        {k: v for k, v in tiny.items() if k not in ("num_key_value_heads", "head_dim")},  # DeepSeek-V2's MLA: no GQA
        {field: 2 for field, value in depth.items() if isinstance(value, int) and not isinstance(value, bool) and value > 2} | repairs,
    ]
    for tier, kwargs in enumerate(tiers):
        for name, sub_class in sub_classes.items():
            subs = list(_tiny_configs(sub_class, base))
            if subs:
                kwargs[name] = subs[min(tier, len(subs) - 1)]
        try:
            yield config_class(**kwargs)
        except Exception:  # the class's own checks: the next, gentler tier
            continue
    yield defaults


def load_hf_config(spec: str) -> Any:
    """A ``transformers`` config from a config or model class name (tiny sizes) or a local ``config.json``.

    Args:
        spec: A config class exported by ``transformers`` (``"LlamaConfig"``, ``"GPT2Config"``),
            or a model class (``"BertForQuestionAnswering"``: its ``config_class``), built with
            :data:`TINY_SHAPE` where the class has those fields (its sub-configs too: a vision
            tower, a text model); or a path to a ``config.json`` file, or to a folder holding one
            (as ``save_pretrained`` writes it), used as is. A path contains a path separator,
            ends in ``.json`` or exists; anything else is a class name.

    Returns:
        A ``transformers.PreTrainedConfig``. Nothing is downloaded: a path is read with
        :mod:`json` and handed to ``AutoConfig.for_model``.

    Raises:
        ImportError: ``transformers`` is not installed.
        FileNotFoundError: The path does not exist.
        ValueError: Not a config or model class name, invalid JSON (the message names the file and
            the position), or the JSON has no ``model_type``.
    """
    transformers = _transformers()
    base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    if _is_path(spec):
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"`hf:{spec}`: no such config file; got {str(path)!r}; expected a path to a config.json")
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"`hf:{spec}`: invalid JSON in {str(path)!r}; got {error.msg} at line {error.lineno} column {error.colno} "
                f"(char {error.pos}); expected a Hugging Face config.json"
            ) from None
        except UnicodeDecodeError as error:
            raise ValueError(f"`hf:{spec}`: not UTF-8 text; got {str(path)!r} ({error.reason} at byte {error.start}); expected a config.json") from None
        except RecursionError:
            raise ValueError(f"`hf:{spec}`: nested too deeply for the JSON parser; got {str(path)!r}; expected a Hugging Face config.json") from None
        model_type = values.pop("model_type", None) if isinstance(values, dict) else None
        if not isinstance(model_type, str):
            raise ValueError(
                f"`hf:{spec}`: config.json has no model_type; got {model_type!r}; "
                "expected a Hugging Face config.json, e.g. with \"model_type\": \"llama\""
            )
        return transformers.AutoConfig.for_model(model_type, **values)
    config_class = _model_class(spec, transformers)
    config_class = getattr(config_class, "config_class", None) if config_class is not None else (
        getattr(transformers, spec, None) if spec.isidentifier() else None
    )  # fmt: skip
    if not (isinstance(config_class, type) and issubclass(config_class, base)):
        names = [n for n in dir(transformers) if n.endswith("Config") or "For" in n] if spec.isidentifier() else []
        raise ValueError(
            f"`hf:{spec}`: not a transformers config or model class; got {spec!r}; expected a class name such as "
            f"LlamaConfig, GPT2Config or BertForQuestionAnswering, or a path to a config.json{did_you_mean(spec, names)}"
        )
    return next(_tiny_configs(config_class, base, spec))


def _auto_class(spec: str, config_class: type, requested: str | None) -> Any:
    """The Auto class that builds ``config_class``: ``requested``, else the first of
    :data:`AUTO_CLASSES` whose mapping has it.

    Raises:
        ValueError: ``requested`` is not an Auto model class of ``transformers``, or has no model
            for the config (the message lists those that do); no Auto class has one.
    """
    transformers = _transformers()

    def builds(name: str) -> bool:
        mapping = getattr(getattr(transformers, name, None), "_model_mapping", None)
        try:
            return mapping is not None and config_class in mapping
        except Exception:  # a mapping entry whose module cannot import: not this one
            return False

    fitting = [name for name in AUTO_CLASSES if builds(name)]
    if requested is None:
        if not fitting:
            raise ValueError(
                f"`hf:{spec}`: no Auto class has a model for this config; got {config_class.__name__}; expected a "
                f"config one of {list(AUTO_CLASSES)} builds, or a model class such as BertForQuestionAnswering"
            )
        if {"AutoModelForCausalLM", "AutoModelForMaskedLM"} <= set(fitting) and not _default_is_decoder(config_class):
            return transformers.AutoModelForMaskedLM  # BERT-like: its causal head wants is_decoder=True
        return getattr(transformers, fitting[0])
    if getattr(getattr(transformers, requested, None), "_model_mapping", None) is None:
        autos = [n for n in dir(transformers) if n.startswith("AutoModel")]
        raise ValueError(
            f"`hf:{spec}`: not an Auto model class of transformers; got {requested!r}; expected one of "
            f"{list(AUTO_CLASSES)} or another AutoModel... class{did_you_mean(requested, autos)}"
        )
    if not builds(requested):
        raise ValueError(
            f"`hf:{spec}`: {requested} has no model for this config; got {config_class.__name__}; "
            f"expected one of the Auto classes that have one: {fitting}"
        )
    return getattr(transformers, requested)


def _default_is_decoder(config_class: type) -> bool:
    try:
        return bool(getattr(config_class(), "is_decoder", False))
    except Exception:  # a class that refuses its defaults: _tiny_configs names the problem
        return False


def _from_auto(auto: Any, config: Any) -> nn.Module:
    model: nn.Module = auto.from_config(config)
    return model


def _first_config_that_runs(spec: str, model_class: Any, auto: Any, configs: Iterator[Any]) -> Any:
    """The first of ``configs`` whose model builds and runs a forward (on the meta device, so it
    costs no memory); else the first that builds. Tiny sizes can break a model's own assumptions
    (ConvNeXt's four stage widths for two stages): the next, less tiny config is tried."""
    from optzoo.routing import trace_uses

    first, error = None, None
    for config in configs:
        try:
            with torch.device("meta"):
                candidate = model_class(config) if model_class is not None else _from_auto(auto, config)
        except Exception as failure:  # sizes this model refuses: the next, gentler tier
            error = failure
            continue
        first = first if first is not None else config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            uses, _ = trace_uses(candidate)
        if uses is not None:
            return config
    if first is None:
        raise ValueError(f"`hf:{spec}`: the model does not build from its config; got {type(error).__name__}: {error}") from error
    return first


def _model_class(spec: str, transformers: ModuleType) -> Any:
    """The ``transformers`` model class named ``spec`` (``BertForQuestionAnswering``), or ``None``.

    Raises:
        ImportError: ``transformers`` exports only a placeholder for the class: it needs a library
            that is not installed (transformers' message names it).
    """
    if not spec.isidentifier():
        return None
    cls = getattr(transformers, spec, None)
    if isinstance(cls, type) and getattr(cls, "is_dummy", False):  # transformers' placeholder for a missing library
        transformers.utils.requires_backends(cls, getattr(cls, "_backends"))  # raises the ImportError naming it
    base = getattr(transformers, "PreTrainedModel", None)
    return cls if isinstance(cls, type) and base is not None and issubclass(cls, base) else None


def build_hf_model(spec: str) -> nn.Module:
    """A randomly initialised model: the class ``spec`` names, or an Auto class's model for a config.

    Builds on the current default device, so ``with torch.device("meta"):`` gives shapes without
    memory (what ``optzoo dump-param-groups --model hf:LlamaConfig`` does). Seed torch first
    for a reproducible init.

    Args:
        spec: A model class (``"BertForQuestionAnswering"``, ``"ViTForImageClassification"``),
            built from its tiny config; or a config class, a ``config.json`` or a folder holding
            one (see :func:`load_hf_config`, without the ``hf:`` prefix of ``--model``), built
            with the first of :data:`AUTO_CLASSES` that has a model for it (a causal LM for
            ``LlamaConfig``, a seq2seq LM for ``T5Config``, an image classifier for
            ``ViTConfig``); a config.json that names its class (``architectures``, as
            ``save_pretrained`` writes it) builds that class. ``SPEC:AutoModelForMaskedLM`` (any
            ``AutoModel...`` class) picks the Auto class. Only the config is read: no weights.

    Returns:
        The model, untouched: optzoo reads its roles from it.

    Raises:
        ImportError: ``transformers`` is not installed.
        FileNotFoundError, ValueError: See :func:`load_hf_config`; ``ValueError`` also when
            the Auto class named has no model for the config, or none of :data:`AUTO_CLASSES` has.

    Example:
        >>> model = build_hf_model("LlamaConfig")
        >>> [(name, tuple(p.shape)) for name, p in model.named_parameters()][:3]
        [('model.embed_tokens.weight', (256, 64)), ('model.layers.0.self_attn.q_proj.weight', (64, 64)), ('model.layers.0.self_attn.k_proj.weight', (32, 64))]
        >>> type(build_hf_model("BertForQuestionAnswering").qa_outputs).__name__
        'Linear'
    """
    transformers = _transformers()
    name, requested = _split_auto(spec)
    model_class = None if _is_path(name) else _model_class(name, transformers)
    if model_class is not None and requested is not None:
        raise ValueError(
            f"`hf:{spec}`: names a model class and an Auto class; got {name} and {requested}; expected one: "
            f"hf:{name}, or hf:{model_class.config_class.__name__}:{requested}"
        )
    if model_class is None and _is_path(name):
        config = load_hf_config(name)
        # save_pretrained records the model class: build that one, unless an Auto class is named.
        saved = (getattr(config, "architectures", None) or [None])[0] if requested is None else None
        saved_class = _model_class(saved, transformers) if isinstance(saved, str) else None
        model = saved_class(config) if saved_class is not None else _from_auto(_auto_class(spec, type(config), requested), config)
    else:
        base = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
        config_class = model_class.config_class if model_class is not None else load_hf_config(name).__class__
        auto = None if model_class is not None else _auto_class(spec, config_class, requested)
        config = _first_config_that_runs(spec, model_class, auto, _tiny_configs(config_class, base, name))
        model = model_class(config) if model_class is not None else _from_auto(auto, config)
    if not isinstance(model, nn.Module):  # pragma: no cover - transformers always returns modules
        raise TypeError(f"`hf:{spec}`: the model class returned {type(model).__name__}; expected a torch.nn.Module")
    return model
