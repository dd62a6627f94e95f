"""Hugging Face models route like Megatron's with no tags: ``hf:`` specs, the CLI, the old tagger.

Tiny Llama and GPT-2 from their config classes (random init, nothing downloaded). With
``optimizer="muon"`` and the standard overrides: attention and MLP matrices go to Muon; the
embeddings and ``lm_head`` to the scalar optimizer (AdamW) with weight decay; every norm and bias
to a group without weight decay; GPT-2's tied ``wte``/``lm_head`` is one param. The roles come
from the models themselves (tests/integrations/test_real_models.py covers the MoE models).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import transformers  # noqa: E402 - in the test extra: missing, it fails here instead of skipping

from optzoo.optimizers.muon import Muon  # noqa: E402
from optzoo import OptimizerConfig, get_optimizer  # noqa: E402
from optzoo.cli import main  # noqa: E402
from optzoo.hf import build_hf_model, load_hf_config, tag_hf_model  # noqa: E402
from optzoo.models import build_model  # noqa: E402
from optzoo.lint import RoutingLintWarning  # noqa: E402
from optzoo.routing import infer_roles  # noqa: E402

MUON = OptimizerConfig(optimizer="muon", lr=0.02, weight_decay=0.1, muon_fp32_matmul_prec="highest")
LAYERS = (0, 1)

LLAMA_MATRICES = [
    f"model.layers.{i}.{name}.weight"
    for i in LAYERS
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
]  # fmt: skip
LLAMA_ENDS = ["model.embed_tokens.weight", "lm_head.weight"]
LLAMA_NORMS = [
    *(f"model.layers.{i}.{norm}.weight" for i in LAYERS for norm in ("input_layernorm", "post_attention_layernorm")),
    "model.norm.weight",
]
GPT2_MATRICES = [
    f"transformer.h.{i}.{name}.weight" for i in LAYERS for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
GPT2_EMBEDDINGS = ["transformer.wte.weight", "transformer.wpe.weight"]  # lm_head is wte (tied)
GPT2_NORMS_AND_BIASES = [
    *(
        f"transformer.h.{i}.{name}"
        for i in LAYERS
        for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.bias", "attn.c_proj.bias",
                     "ln_2.weight", "ln_2.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")
    ),
    "transformer.ln_f.weight",
    "transformer.ln_f.bias",
]  # fmt: skip


def groups(optimizer: Any) -> list[tuple[str, float, float, list[str]]]:
    return [(g["optimizer"], g["lr"], g["weight_decay"], g["param_names"]) for g in optimizer.param_groups]


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    return build_hf_model("LlamaConfig")


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return build_hf_model("GPT2Config")


# ---- routing ---------------------------------------------------------------------------------


def test_llama_muon_takes_attention_and_mlp_matrices_adam_the_ends_and_no_decay_on_norms(llama: nn.Module) -> None:
    assert groups(get_optimizer(MUON, llama)) == [
        ("muon", 0.02, 0.1, LLAMA_MATRICES),
        ("adam", 0.02, 0.1, LLAMA_ENDS),
        ("adam", 0.02, 0.0, LLAMA_NORMS),
    ]


def test_gpt2_routes_conv1d_matrices_to_muon_embeddings_to_adam_tied_head_once(gpt2: nn.Module) -> None:
    optimizer = get_optimizer(MUON, gpt2)
    assert groups(optimizer) == [
        ("muon", 0.02, 0.1, GPT2_MATRICES),
        ("adam", 0.02, 0.1, GPT2_EMBEDDINGS),
        ("adam", 0.02, 0.0, GPT2_NORMS_AND_BIASES),
    ]
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    names = [name for group in optimizer.param_groups for name in group["param_names"]]
    assert "lm_head.weight" not in names
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(gpt2.parameters()))


def test_every_param_is_routed_exactly_once(llama: nn.Module, gpt2: nn.Module) -> None:
    for model in (llama, gpt2):
        routed = [id(p) for g in get_optimizer(MUON, model).param_groups for p in g["params"]]
        assert sorted(routed) == sorted(id(p) for p in model.parameters())


def test_decoupled_lr_reaches_every_embedding_and_the_head(gpt2: nn.Module) -> None:
    optimizer = get_optimizer(MUON.replace(decoupled_lr=1e-3), gpt2)
    lr = {name: g["lr"] for g in optimizer.param_groups for name in g["param_names"]}
    assert lr["transformer.wte.weight"] == 1e-3  # also lm_head: the same tensor
    assert lr["transformer.wpe.weight"] == 1e-3  # an embedding too (role), unlike Megatron's untagged positions
    assert lr["transformer.h.0.attn.c_attn.weight"] == 0.02
    optimizer_of = {name: g["optimizer"] for g in optimizer.param_groups for name in g["param_names"]}
    assert optimizer_of["transformer.wpe.weight"] == "adam"



def test_models_are_built_untouched(llama: nn.Module, gpt2: nn.Module) -> None:
    for model in (llama, gpt2):
        for param in model.parameters():
            assert not hasattr(param, "is_embedding_or_output_parameter") and not hasattr(param, "use_muon")
    # GPT-2's fused c_attn holds Q, K, V in its columns; Muon's split is by rows: no split shapes.
    assert not any(hasattr(p, "qkv_split_shapes") for p in gpt2.parameters())


@pytest.mark.parametrize("spec", ["LlamaConfig", "GPT2Config"])
def test_the_deprecated_tagger_still_tags_and_routes_as_inference_does(spec: str) -> None:
    torch.manual_seed(0)
    untagged, tagged = build_hf_model(spec), build_hf_model(spec)
    with pytest.warns(DeprecationWarning, match=r"^`optzoo\.hf\.tag_hf_model`: deprecated \(optzoo reads embeddings"):
        tags = tag_hf_model(tagged)
    expected = {"LlamaConfig": dict.fromkeys(LLAMA_ENDS, "is_embedding_or_output_parameter"), "GPT2Config": {
        "transformer.wte.weight": "is_embedding_or_output_parameter", "transformer.wpe.weight": "use_muon=False",
    }}[spec]  # fmt: skip
    assert tags == expected
    routed = [[(g["optimizer"], g["weight_decay"], g["param_names"]) for g in get_optimizer(MUON, m).param_groups] for m in (untagged, tagged)]
    assert routed[0] == routed[1]


def test_an_explicit_use_muon_true_wins_over_the_role() -> None:
    model = transformers.AutoModelForCausalLM.from_config(load_hf_config("GPT2Config"))
    model.transformer.wpe.weight.use_muon = True
    with pytest.warns(RoutingLintWarning, match=(
        r"^lint: embedding-on-matrix-optimizer: `transformer\.wpe\.weight`: input table or head routed to muon by "
        r"tag use_muon=True; got param group #0 \(muon\); expected them on the scalar optimizer \(adam\), "
        r"where tables and heads train better: drop the tag, or add \{ParamKey\(name='transformer\.wpe\.weight'\): "
        r"\{'optimizer': 'adam'\}\}$"
    )):  # fmt: skip
        optimizer = get_optimizer(MUON, model)
    assert "transformer.wpe.weight" in optimizer.param_groups[0]["param_names"]


def test_a_step_trains_both_models(llama: nn.Module, gpt2: nn.Module) -> None:
    for model in (llama, gpt2):
        optimizer = get_optimizer(MUON, model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = torch.randint(0, 256, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        ok, norm, _ = optimizer.step()
        assert ok and norm is not None and norm > 0
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed == set(before)


def test_muon_on_a_transposed_weight_is_the_transposed_update() -> None:
    # Conv1D stores in x out: with the default spectral scale, Muon's update is the transpose of
    # the nn.Linear one. Tolerance: fp32 Newton-Schulz at highest precision on a 24x40 matrix.
    weight, grad = torch.randn(24, 40), torch.randn(24, 40)
    linear, conv = nn.Parameter(weight.clone()), nn.Parameter(weight.T.clone())
    linear.grad, conv.grad = grad.clone(), grad.T.clone()
    for param in (linear, conv):
        Muon([param], lr=0.1, weight_decay=0.1, fp32_matmul_prec="highest").step()
    torch.testing.assert_close(conv.detach().T, linear.detach(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["spectral", "unit_rms_norm", "shape_scaling"])
def test_gpt2s_conv1d_is_stepped_as_the_linear_its_forward_computes(mode: str) -> None:
    # Conv1D.forward is addmm(bias, x, weight): weight is in x out, so each update is that of the
    # out x in nn.Linear, transposed, scale factor included (rectangular c_fc: 64 x 256).
    torch.manual_seed(0)
    model = build_hf_model("GPT2Config")
    config = MUON.replace(muon_scale_mode=mode, muon_fp32_matmul_prec="highest", clip_grad=0.0, weight_decay=0.0)
    optimizer = get_optimizer(config, model, lint=False)
    c_fc = model.transformer.h[0].mlp.c_fc.weight
    group = next(g for g in optimizer.param_groups if any(p is c_fc for p in g["params"]))
    view = group["matrix_views"][[p is c_fc for p in group["params"]].index(True)]
    assert (view.count, *view.shape) == (1, 256, 64)
    linear = nn.Parameter(c_fc.detach().T.clone())
    reference = Muon([linear], lr=config.lr, weight_decay=0.0, fp32_matmul_prec="highest", scale_mode=mode)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    linear.grad = c_fc.grad.T.clone()
    optimizer.step()
    reference.step()
    # fp32 Newton-Schulz at highest precision, the same matrix laid out transposed: float32 rounding
    torch.testing.assert_close(c_fc.detach().T, linear.detach(), atol=1e-5, rtol=1e-5)


def test_a_peft_wrapped_model_is_traced_through_its_wrapper() -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(build_hf_model("LlamaConfig"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    roles = infer_roles(model)
    trainable = {n: roles[id(p)] for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 8  # lora_A and lora_B of q_proj and v_proj, two layers
    # peft's Linear: base(x) + lora_B(lora_A(dropout(x))) * scaling: both are matmul weights
    assert {r.describe() for r in trainable.values()} == {"matrix (forward: mm weight)"}
    optimizer = get_optimizer(MUON, model)
    assert [(g["optimizer"], len(g["params"])) for g in optimizer.param_groups] == [("muon", 8)]


# ---- building from specs ---------------------------------------------------------------------


def test_build_model_hf_spec_builds_on_meta_by_default() -> None:
    model = build_model("hf:LlamaConfig")
    assert isinstance(model, nn.Module)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    # LlamaForCausalLM.forward: logits = self.lm_head(hidden_states[:, slice_indices, :]), returned as is
    assert infer_roles(model)[id(model.lm_head.weight)].describe() == "output (forward: mm weight, its product an output)"


def test_config_json_file_or_folder_builds_the_same_model(tmp_path: Path) -> None:
    config = load_hf_config("LlamaConfig")
    config.num_hidden_layers = 1
    config.to_json_file(str(tmp_path / "config.json"))
    for spec in (f"hf:{tmp_path}/config.json", f"hf:{tmp_path}"):
        model = build_model(spec)
        assert isinstance(model, nn.Module)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert shapes["model.embed_tokens.weight"] == (256, 64)
        assert "model.layers.1.mlp.up_proj.weight" not in shapes
        assert "embedding" in infer_roles(model)[id(model.model.embed_tokens.weight)]


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("hf:NoSuchConfig", ValueError, r"^`hf:NoSuchConfig`: not a transformers config or model class; got 'NoSuchConfig'"),
        ("hf:AutoConfig", ValueError, r"^`hf:AutoConfig`: not a transformers config or model class"),
        # issue 25: hf:ViTConfig now builds (AutoModelForImageClassification); a named Auto class without a model fails
        ("hf:ViTConfig:AutoModelForCausalLM", ValueError, r"^`hf:ViTConfig:AutoModelForCausalLM`: AutoModelForCausalLM has no model for this config; got ViTConfig"),
        ("hf:/no/such/config.json", FileNotFoundError, r"^`hf:/no/such/config.json`: no such config file"),
    ],
)
def test_bad_hf_specs_raise_naming_the_spec(spec: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        build_model(spec)


def test_a_config_class_refusing_its_own_defaults_is_named_with_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = sys.modules["transformers"]  # AutoModel*.from_config can put a fresh module there
    class RefusingConfig(transformers.PretrainedConfig):  # as Gemma4AssistantConfig in transformers 5.24
        def __init__(self, **kwargs: Any) -> None:
            raise ValueError("hidden_size_per_layer_input must be 0, got 256")

    monkeypatch.setattr(transformers, "RefusingConfig", RefusingConfig, raising=False)
    message = (
        r"^`hf:RefusingConfig`: RefusingConfig does not build from its own defaults, so optzoo has no config to shrink; "
        r"got ValueError: hidden_size_per_layer_input must be 0, got 256$"
    )
    with pytest.raises(ValueError, match=message):
        build_model("hf:RefusingConfig")


def test_a_placeholder_for_a_missing_library_names_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from transformers.utils.import_utils import DummyObject

    transformers = sys.modules["transformers"]  # AutoModel*.from_config can put a fresh module there

    if importlib.util.find_spec("detectron2") is not None:
        pytest.skip("detectron2 is installed: transformers exports the real class")

    class NeedsDetectron2Model(metaclass=DummyObject):  # what transformers exports when a class's library is missing
        _backends = ["detectron2"]

    monkeypatch.setattr(transformers, "NeedsDetectron2Model", NeedsDetectron2Model, raising=False)
    with pytest.raises(ImportError, match=r"^\s*NeedsDetectron2Model requires the detectron2 library but it was not found"):
        build_model("hf:NeedsDetectron2Model")


def test_config_json_without_model_type_raises(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match=r"config.json has no model_type; got None"):
        build_model(f"hf:{tmp_path}/config.json")


def test_tag_hf_model_rejects_a_plain_module() -> None:
    with pytest.raises(TypeError, match=r"^`model`: not a Hugging Face model; got Linear without get_input_embeddings"):
        with pytest.warns(DeprecationWarning):
            tag_hf_model(nn.Linear(2, 2))


def test_missing_transformers_names_the_package(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r"^`transformers`: needed for Hugging Face models; .*pip install transformers"):
        build_model("hf:LlamaConfig")
    assert main(["dump-param-groups", "--model", "hf:LlamaConfig"]) == 2
    assert capsys.readouterr().err.startswith("optzoo: error: `transformers`: needed for Hugging Face models")


# ---- the CLI ---------------------------------------------------------------------------------


def dump_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["dump-param-groups", "--format", "json", *argv]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    document: dict[str, Any] = json.loads(out)
    return document


def by_group(document: dict[str, Any]) -> list[tuple[str, float, list[str]]]:
    return [
        (group["optimizer"], group["weight_decay"], [n for n, i in document["param_to_group"].items() if i == group["index"]])
        for group in document["groups"]
    ]


def test_cli_dumps_llama_groups_with_the_default_config(capsys: pytest.CaptureFixture[str]) -> None:
    document = dump_json(capsys, "--model", "hf:LlamaConfig")
    assert by_group(document) == [
        ("adam", 0.01, [*LLAMA_ENDS[:1], *LLAMA_MATRICES, LLAMA_ENDS[1]]),
        ("adam", 0.0, LLAMA_NORMS),
    ]


def test_cli_dumps_muon_groups_from_a_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "muon.toml"
    config.write_text('[config]\noptimizer = "muon"\nlr = 0.02\nweight_decay = 0.1\n')
    assert by_group(dump_json(capsys, "--model", "hf:LlamaConfig", "--config", str(config))) == [
        ("muon", 0.1, LLAMA_MATRICES),
        ("adam", 0.1, LLAMA_ENDS),
        ("adam", 0.0, LLAMA_NORMS),
    ]
    # GPT-2: the tied head is listed under both names, in the group of the one tensor.
    assert by_group(dump_json(capsys, "--model", "hf:GPT2Config", "--config", str(config))) == [
        ("muon", 0.1, GPT2_MATRICES),
        ("adam", 0.1, ["transformer.wte.weight", "lm_head.weight", "transformer.wpe.weight"]),
        ("adam", 0.0, GPT2_NORMS_AND_BIASES),
    ]


# ---- shipped recipes on Hugging Face models -------------------------------------------------


def routed(model: nn.Module, recipe: str) -> dict[tuple[str, float], set[str]]:
    """``{(optimizer, weight_decay): names}`` under a shipped recipe."""
    from optzoo import load_recipe

    config, overrides = load_recipe(recipe)
    table: dict[tuple[str, float], set[str]] = {}
    for group in get_optimizer(config, model, overrides).param_groups:
        table.setdefault((group["optimizer"], group["weight_decay"]), set()).update(group["param_names"])
    return table


def test_recipe_muon_llm_on_llama_and_gpt2(llama: nn.Module, gpt2: nn.Module) -> None:
    assert routed(llama, "muon-llm") == {
        ("muon", 0.1): set(LLAMA_MATRICES),
        ("adam", 0.1): set(LLAMA_ENDS),
        ("adam", 0.0): set(LLAMA_NORMS),
    }
    assert routed(gpt2, "muon-llm") == {
        ("muon", 0.1): set(GPT2_MATRICES),
        ("adam", 0.1): set(GPT2_EMBEDDINGS),  # the tied head is wte: once
        ("adam", 0.0): set(GPT2_NORMS_AND_BIASES),
    }


def test_recipe_adamw_no_decay_norms_on_llama_and_gpt2(llama: nn.Module, gpt2: nn.Module) -> None:
    assert routed(llama, "adamw-no-decay-norms") == {
        ("adam", 0.1): {*LLAMA_MATRICES, *LLAMA_ENDS},
        ("adam", 0.0): set(LLAMA_NORMS),
    }
    assert routed(gpt2, "adamw-no-decay-norms") == {
        ("adam", 0.1): {*GPT2_MATRICES, *GPT2_EMBEDDINGS},
        ("adam", 0.0): set(GPT2_NORMS_AND_BIASES),
    }


def test_recipe_lion_llm_on_llama_and_gpt2(llama: nn.Module, gpt2: nn.Module) -> None:
    assert routed(llama, "lion-llm") == {
        ("lion", 1.0): {*LLAMA_MATRICES, *LLAMA_ENDS},
        ("lion", 0.0): set(LLAMA_NORMS),
    }
    assert routed(gpt2, "lion-llm") == {
        ("lion", 1.0): {*GPT2_MATRICES, *GPT2_EMBEDDINGS},
        ("lion", 0.0): set(GPT2_NORMS_AND_BIASES),
    }
