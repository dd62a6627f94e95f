"""Built-in models with Megatron-style parameter names, for demos, tests and the CLI.

``GPT`` names its parameters the way Megatron-Core's local-spec GPT does
(``embedding.word_embeddings.weight``, ``decoder.layers.N.self_attention.linear_qkv.weight``,
``decoder.layers.N.input_layernorm.weight``, ``output_layer.weight``, ...), and tags the
embedding and output weights with ``is_embedding_or_output_parameter`` as Megatron does, so
routing recipes written for Megatron apply unchanged.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from optzoo._common import did_you_mean

__all__ = [
    "BUILTIN_MODELS",
    "GPT",
    "GPTConfig",
    "build_model",
]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the built-in GPT."""

    vocab_size: int = 256
    """Byte-level by default: the demo trains on raw bytes."""
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    ffn_hidden_size: int | None = None
    """``None``: 4 x hidden_size."""
    max_seq_len: int = 128
    tie_embeddings: bool = False
    """Share ``embedding.word_embeddings.weight`` with ``output_layer.weight``."""
    qk_layernorm: bool = False
    """Add ``q_layernorm``/``k_layernorm`` (exercises ``apply_wd_to_qk_layernorm``)."""


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_heads
        if hidden % heads:
            raise ValueError(
                f"`GPTConfig.hidden_size`: must be divisible by num_heads={heads}; got {hidden}; "
                f"expected a multiple of {heads}"
            )
        self.num_heads = heads
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        # Megatron's fused layout: per query group (here every head) its q, k and v rows in
        # turn; Muon's QKV split orthogonalises each block separately.
        self.linear_qkv.weight.qkv_split_shapes = [hidden // heads] * 3  # type: ignore[attr-defined]
        self.linear_proj = nn.Linear(hidden, hidden)
        head_dim = hidden // heads
        self.q_layernorm = nn.LayerNorm(head_dim) if config.qk_layernorm else None
        self.k_layernorm = nn.LayerNorm(head_dim) if config.qk_layernorm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.linear_qkv(x).view(batch, seq, self.num_heads, 3, hidden // self.num_heads)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(batch, seq, hidden))  # type: ignore[no-any-return]


class _MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        ffn = config.ffn_hidden_size or 4 * config.hidden_size
        self.linear_fc1 = nn.Linear(config.hidden_size, ffn)
        self.linear_fc2 = nn.Linear(ffn, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # type: ignore[no-any-return]


class _Layer(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = _Attention(config)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))  # type: ignore[no-any-return]


class _Embedding(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_seq_len, config.hidden_size)
        self.word_embeddings.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.word_embeddings(tokens) + self.position_embeddings(positions)  # type: ignore[no-any-return]


class _Decoder(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)  # type: ignore[no-any-return]


class GPT(nn.Module):
    """A small pre-norm GPT with Megatron-Core parameter names.

    Example:
        >>> model = GPT(GPTConfig(num_layers=1, hidden_size=8, num_heads=2, vocab_size=16))
        >>> [name for name, _ in model.named_parameters()][:3]
        ['embedding.word_embeddings.weight', 'embedding.position_embeddings.weight', 'decoder.layers.0.input_layernorm.weight']
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        self.embedding = _Embedding(self.config)
        self.decoder = _Decoder(self.config)
        self.output_layer = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_embeddings:
            self.output_layer.weight = self.embedding.word_embeddings.weight
        self.output_layer.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output_layer(self.decoder(self.embedding(tokens)))  # type: ignore[no-any-return]

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on ``tokens`` of shape (batch, seq + 1)."""
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


BUILTIN_MODELS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: GPT(GPTConfig()),
    "gpt-tied": lambda: GPT(GPTConfig(tie_embeddings=True)),
    "gpt-qk-norm": lambda: GPT(GPTConfig(qk_layernorm=True)),
    "gpt-small": lambda: GPT(GPTConfig(hidden_size=512, num_layers=8, num_heads=8, max_seq_len=512)),
    "gpt-medium": lambda: GPT(
        GPTConfig(hidden_size=1024, num_layers=24, num_heads=16, vocab_size=50304, max_seq_len=1024)
    ),
}
"""Built-in model names for ``--model`` (``gpt-medium`` is ~350M parameters: use the meta device)."""


def build_model(spec: str, *, device: str | torch.device = "meta") -> nn.Module | list[nn.Module]:
    """Build a built-in model by name, a Hugging Face model (``hf:...``), or call ``package.module:callable``.

    The model is built under ``device`` (``meta`` by default: shapes without memory).
    ``hf:LlamaConfig`` (a ``transformers`` config class, tiny sizes), ``hf:path/to/config.json``
    or ``hf:path/to/folder`` (as ``save_pretrained`` writes it; ``:AutoModelForX`` after any of
    them picks the Auto class) builds a randomly initialised model with
    :func:`optzoo.hf.build_hf_model`. The ``optzoo`` command imports ``package.module`` with the
    current directory first on the import path, as ``python -m`` has it.

    Raises:
        ValueError: Unknown built-in name or a malformed spec.
        ImportError: The module in ``package.module:callable`` cannot be imported, or
            ``transformers`` is missing for ``hf:``.
        TypeError: The callable does not return a module or a list of modules.
    """
    if spec.startswith("hf:"):
        from optzoo.hf import build_hf_model  # transformers is optional: import it only when asked

        with torch.device(device):
            return build_hf_model(spec.removeprefix("hf:"))
    return _build(spec, device)


def _build(spec: str, device: str | torch.device) -> nn.Module | list[nn.Module]:
    if spec in BUILTIN_MODELS:
        factory = BUILTIN_MODELS[spec]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ValueError(f"`--model`: malformed spec; got {spec!r}; expected package.module:callable")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError:
            raise
        except (Exception, SystemExit) as error:  # user code (a SyntaxError, a raise, sys.exit): one line
            raise ValueError(
                f"`--model`: importing {module_name!r} failed; got {type(error).__name__}: {error}; "
                "expected a module that imports cleanly"
            ) from error
        try:
            factory = getattr(module, attr)
        except AttributeError:
            raise ValueError(
                f"`--model`: module {module_name!r} has no attribute {attr!r}; got {spec!r}; "
                "expected package.module:callable"
            ) from None
    else:
        raise ValueError(
            f"`--model`: unknown model; got {spec!r}; expected one of {sorted(BUILTIN_MODELS)} "
            f"or package.module:callable{did_you_mean(spec, BUILTIN_MODELS)}"
        )
    if not callable(factory):
        raise TypeError(
            f"`--model`: not a callable; got {spec!r} ({type(factory).__name__}); "
            "expected package.module:callable returning a module or a list of modules"
        )
    try:
        with torch.device(device):
            model = factory()
    except (Exception, SystemExit) as error:  # user code: report it in one line, whatever it raised
        raise ValueError(
            f"`--model`: building the model failed; got {spec!r} raising {type(error).__name__}: {error}; "
            "expected it to return a module or a list of modules"
        ) from error
    if isinstance(model, nn.Module):
        return model
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) for m in model):
        return list(model)
    raise TypeError(
        f"`--model`: {spec!r} returned {type(model).__name__}; expected a torch.nn.Module "
        "or a list of modules"
    )
