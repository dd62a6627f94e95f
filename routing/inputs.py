"""Inputs to observe a model's forward with: the user's, or made from the model itself.

:func:`trace_uses` runs :func:`~optzoo.routing.dataflow.observe` on a module with
``example_inputs`` when given, else with inputs made from the model:

* a Hugging Face model (anything with a ``config`` and a ``main_input_name``, read by attribute,
  so ``transformers`` is not imported): its main input from the config (``input_ids``;
  ``pixel_values`` of ``num_channels x image_size``; ``input_features`` or ``input_values`` for
  audio), ``decoder_input_ids`` for encoder-decoders, the other inputs its ``forward`` requires,
  and ``use_cache=False``;
* any other module whose ``forward`` takes one tensor: a batch shaped for its first layers, tried
  in registration order (token ids for an ``Embedding``, features for a ``Linear``, an image or a
  signal for a ``Conv``, a sequence for an RNN).

Wrappers are looked through: DDP and ``DataParallel`` (``.module``), ``torch.compile``
(``._orig_mod``), PEFT (``get_base_model()``) and any wrapper whose ``.module`` holds all its
parameters. Only shapes and dtypes matter: the forward runs on the meta device.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .dataflow import ParamUse, TraceError, observe

__all__ = ["ExampleInputs", "example_inputs", "has_forward", "trace_uses"]

ExampleInputs = torch.Tensor | Sequence[Any] | Mapping[str, Any]
"""A module's inputs: one tensor, a tuple or list of positional arguments, or a dict of keyword arguments."""

BATCH, SEQUENCE = 1, 16
"""The batch and sequence sizes of made inputs (meta tensors: their size costs nothing). One sequence:
Hugging Face's sequence classifiers refuse a batch of several without a padding token."""


def _unwrap_runnable(module: nn.Module) -> nn.Module:
    """The module to call: DDP/``DataParallel`` and ``torch.compile`` wrappers removed (their
    forwards synchronise ranks or compile; the inner module computes the same)."""
    while True:
        kind = type(module).__name__
        inner = getattr(module, "module", None) if kind in ("DistributedDataParallel", "DataParallel") else None
        compiled = getattr(module, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            module = inner
        elif isinstance(compiled, nn.Module):
            module = compiled
        else:
            return module


def _unwrap_model(module: nn.Module) -> nn.Module:
    """The model underneath any wrapper (also PEFT's and a ``.module`` wrapper's), whose config says
    what inputs it takes."""
    seen: set[int] = set()
    while id(module) not in seen:
        seen.add(id(module))
        module = _unwrap_runnable(module)
        base = getattr(module, "get_base_model", None)
        inner = getattr(module, "module", None)
        if callable(base):  # PEFT forwards attributes to the base model: its signature is (*args, **kwargs)
            try:
                candidate = base()
            except Exception:  # not PEFT's: a method of another meaning
                candidate = None
            if isinstance(candidate, nn.Module) and candidate is not module:
                module = candidate
                continue
        if isinstance(inner, nn.Module) and _holds_all_params(inner, module):
            module = inner
    return module


def _holds_all_params(inner: nn.Module, outer: nn.Module) -> bool:
    ids = {id(p) for p in inner.parameters()}
    return bool(ids) and all(id(p) in ids for p in outer.parameters())


def _attribute(holder: Any, name: str) -> Any:
    """``getattr(holder, name, None)``, also when a config raises something else than ``AttributeError``."""
    try:
        return getattr(holder, name, None)
    except Exception:  # transformers' per-layer attributes raise their own error for a global read
        return None


def has_forward(module: nn.Module) -> bool:
    """Whether the model underneath any wrapper defines a forward (a ``ModuleDict`` of params does not)."""
    model = _unwrap_model(module)
    forward = getattr(type(model), "forward", None)
    return forward is not None and forward is not nn.Module.forward and not isinstance(
        model, (nn.ModuleDict, nn.ModuleList, nn.ParameterList, nn.ParameterDict)
    )


def _config_value(config: Any, *names: str) -> Any:
    """The first of ``names`` that ``config`` or one of its sub-configs (vision, audio, text) sets."""
    for holder in (config, *(_attribute(config, sub) for sub in ("vision_config", "audio_config", "encoder", "text_config"))):
        for name in names:
            value = _attribute(holder, name) if holder is not None else None
            if value is not None:
                return value
    return None


def _image(config: Any) -> torch.Tensor:
    channels = _config_value(config, "num_channels", "in_channels", "input_channels") or 3
    size = _config_value(config, "image_size", "img_size", "input_size") or 224
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    return torch.empty(BATCH, int(channels), int(height), int(width))


def _audio_features(config: Any) -> torch.Tensor:
    mels = _config_value(config, "num_mel_bins")
    positions = _config_value(config, "max_source_positions")
    if mels is not None and positions is not None:  # Whisper: (batch, mels, 2 x positions) before its stride-2 conv
        return torch.empty(BATCH, int(mels), 2 * int(positions))
    per_channel = _config_value(config, "input_feat_per_channel", "feature_size", "num_mel_bins") or 80
    channels = _config_value(config, "input_channels") or 1
    return torch.empty(BATCH, 4 * SEQUENCE, int(per_channel) * int(channels))


def _audio_values(config: Any) -> torch.Tensor:
    length = _config_value(config, "max_length")
    mels = _config_value(config, "num_mel_bins")
    if length is not None and mels is not None:  # a spectrogram (AST): (batch, frames, mels)
        return torch.empty(BATCH, int(length), int(mels))
    return torch.empty(BATCH, 16000)  # one second of 16 kHz audio


def _video(config: Any) -> torch.Tensor | None:
    """``(batch, frames, channels, height, width)`` for a video model (its config has ``num_frames``)."""
    frames = _config_value(config, "num_frames")
    if not isinstance(frames, int):
        return None
    image = _image(config)
    return torch.empty(BATCH, frames, *image.shape[1:])


def _video_channels_first(config: Any) -> torch.Tensor | None:
    video = _video(config)
    return None if video is None else video.transpose(1, 2)


def _audio_channels(config: Any) -> torch.Tensor:
    """``(batch, channels, samples)``: a codec's waveform (EnCodec, Mimi)."""
    channels = _config_value(config, "audio_channels", "num_channels") or 1
    return torch.empty(BATCH, int(channels), 16000)


_ALTERNATIVES = {"pixel_values": (_video, _video_channels_first), "input_values": (_audio_channels,)}
"""Other shapes a main input may take, tried when the first fails."""


def _ids(config: Any) -> torch.Tensor:
    return torch.zeros(BATCH, SEQUENCE, dtype=torch.long)


def _choices(config: Any) -> torch.Tensor:
    return torch.zeros(BATCH, 2, SEQUENCE, dtype=torch.long)  # Hugging Face's *ForMultipleChoice: (batch, choices, length)


_MAKERS = {
    "input_ids": _ids,
    "decoder_input_ids": _ids,
    "pixel_values": _image,
    "input_features": _audio_features,
    "input_values": _audio_values,
}
_OFF = {"use_cache": False, "output_attentions": False, "output_hidden_states": False, "return_dict": True}


def _hf_inputs(model: nn.Module) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | str:
    """Keyword inputs for a Hugging Face model from its config, or why none can be made: every
    input it can use, then its main input alone (a multimodal model whose image tokens the made
    ids do not hold still runs its text model)."""
    config = getattr(model, "config", None)
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return f"{type(model).__name__}.forward has no signature to read"
    main = getattr(model, "main_input_name", "input_ids")
    if isinstance(main, (list, tuple)):  # OneFormer names several
        main = main[0] if main else "input_ids"
    makers = dict(_MAKERS)
    if type(model).__name__.endswith("ForMultipleChoice"):
        makers["input_ids"] = _choices
    guesses: list[Any] = []
    if main not in makers:  # a name of the model's own (Perceiver's `inputs`): token ids, else an image
        if _input_embedding(model) is not None or _config_value(config, "vocab_size") is not None:
            guesses.append(_ids)
        if _config_value(config, "image_size") is not None:
            guesses.append(_image)
        if guesses:
            makers[main] = guesses.pop(0)
    guesses += list(_ALTERNATIVES.get(main, ()))
    kwargs: dict[str, Any] = {}
    optional: list[str] = []
    for name in dict.fromkeys([main, *parameters]):
        parameter = parameters.get(name)
        if parameter is None or parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name in makers and (name == main or parameter.default is inspect.Parameter.empty or _wants(config, name)):
            kwargs[name] = makers[name](config)
            if name != main and parameter.default is not inspect.Parameter.empty and name != "decoder_input_ids":
                optional.append(name)
        elif name in _OFF:
            kwargs[name] = _OFF[name]
        elif parameter.default is inspect.Parameter.empty:
            return f"{type(model).__name__}.forward requires `{name}`, which optzoo cannot make from the config"
    candidates = [((), kwargs)]
    if optional:
        candidates.append(((), {k: v for k, v in kwargs.items() if k not in optional}))
    made = [guess(config) for guess in guesses]
    candidates += [((), {**kwargs, main: value}) for value in made if value is not None]
    return candidates


def _input_embedding(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except Exception:  # the model's own method: vision models raise NotImplementedError
        return None
    return embedding if isinstance(embedding, (nn.Embedding, nn.EmbeddingBag)) else None


def _wants(config: Any, name: str) -> bool:
    """Optional inputs worth making: the decoder's ids of an encoder-decoder, the image of a model with an image tower."""
    if name == "decoder_input_ids":
        return bool(_attribute(config, "is_encoder_decoder"))
    return name == "pixel_values" and _attribute(config, "vision_config") is not None


def _plain_inputs(model: nn.Module) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Single-tensor inputs shaped for the module's first layers, in registration order."""
    made: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            made.append(torch.zeros(BATCH, SEQUENCE, dtype=torch.long))
        elif isinstance(module, nn.Linear):
            made += [torch.empty(BATCH, SEQUENCE, module.in_features), torch.empty(BATCH, module.in_features)]
        elif isinstance(module, nn.modules.conv._ConvNd):
            channels = module.out_channels if module.transposed else module.in_channels
            made.append(torch.empty(BATCH, channels, *[32] * len(module.kernel_size)))
        elif isinstance(module, nn.RNNBase):
            made.append(torch.empty(BATCH, SEQUENCE, module.input_size))
        if len(made) >= 4:
            break
    seen: set[tuple[Any, ...]] = set()
    for tensor in made:
        key = (tuple(tensor.shape), tensor.dtype)
        if key not in seen:
            seen.add(key)
            yield (tensor,), {}


def _required_positional(module: nn.Module) -> int | None:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def example_inputs(module: nn.Module) -> list[tuple[tuple[Any, ...], dict[str, Any]]] | str:
    """Candidate ``(args, kwargs)`` for one forward of ``module``, made from the model; or why none.

    Example:
        >>> [tuple(args[0].shape) for args, _ in example_inputs(nn.Sequential(nn.Linear(3, 4), nn.ReLU()))]
        [(1, 16, 3), (1, 3), (2, 16, 3), (2, 3)]
    """
    model = _unwrap_model(module)
    if getattr(model, "config", None) is not None and hasattr(model, "main_input_name"):
        made = _hf_inputs(model)
    else:
        required = _required_positional(model)
        if required == 0:
            return [((), {})]
        if required != 1:
            return f"{type(model).__name__}.forward takes {required if required is not None else 'unknown'} positional inputs"
        made = list(_plain_inputs(model)) or (
            f"{type(model).__name__} has no first layer (Embedding, Linear, Conv, RNN) to shape an input for"
        )  # fmt: skip
    if isinstance(made, str):
        return made
    # A batch of two, tried last: a BatchNorm in training mode refuses one value per channel.
    return made + [_batch_of_two(args, kwargs) for args, kwargs in made]


def _batch_of_two(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def doubled(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == BATCH:
            return value.new_zeros((2 * BATCH, *value.shape[1:]))
        return value

    return tuple(doubled(a) for a in args), {k: doubled(v) for k, v in kwargs.items()}


def _as_call(example: ExampleInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (list, tuple)):
        return tuple(example), {}
    raise TypeError(
        f"`example_inputs`: not a tensor, a tuple or list of positional inputs, or a dict of keyword inputs; "
        f"got {type(example).__name__}; expected e.g. torch.zeros(2, 16, dtype=torch.long) or {{'input_ids': ...}}"
    )


def trace_uses(module: nn.Module, example: ExampleInputs | None = None) -> tuple[dict[int, ParamUse] | None, str]:
    """Each parameter's :class:`~optzoo.routing.dataflow.ParamUse` in one forward of ``module``.

    Returns:
        ``(uses, how)``: the uses by ``id(param)`` and which inputs gave them; or ``(None, why)``
        when no input could be made or every forward failed (the first failure's message).

    Raises:
        TypeError: ``example`` is not a tensor, a sequence or a mapping.
    """
    runnable = _unwrap_runnable(module)
    model = _unwrap_model(module)
    if example is not None:
        candidates = [_as_call(example)]
        origin = "example_inputs"
    else:
        try:
            made = example_inputs(module)
        except Exception as error:  # a model's config or signature that reads in ways not foreseen
            return None, f"making its inputs failed: {type(error).__name__}: {error}"
        if isinstance(made, str):
            return None, made
        candidates, origin = made, "inputs made from the model"
    failures: list[str] = []
    for args, kwargs in candidates:
        for target in dict.fromkeys([runnable, model]):
            for truth in (False, True):  # a condition on values meta tensors lack: false, else true
                try:
                    return observe(target, args, kwargs, truth=truth), f"{origin}: {_shapes(args, kwargs)}"
                except TraceError as error:
                    failures.append(str(error))
    return None, f"its forward failed on {origin} ({_shapes(*candidates[0])}): {failures[0]}"


def _shapes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return "x".join(map(str, value.shape)) + ("" if value.is_floating_point() else f" {str(value.dtype).removeprefix('torch.')}")
        return repr(value)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(parts) or "no inputs"
