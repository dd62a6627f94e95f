"""SOAP through get_optimizer: emerging-optimizers' SOAP on matrices, the scalar optimizer elsewhere."""

from __future__ import annotations

import pytest
import torch
from emerging_optimizers.soap.soap import SOAP

from optzoo import OptimizerConfig, ParamKey, get_optimizer
from tests.conftest import fill_grads, tiny_gpt, tokens, twin

CONFIG = OptimizerConfig(optimizer="soap", lr=3e-3, weight_decay=0.1, adam_beta2=0.95, soap_shampoo_beta=0.9, clip_grad=0.0)


def test_soap_equals_emerging_optimizers_soap_on_the_matrices(odd_model: torch.nn.Module) -> None:
    reference_model = twin(odd_model)
    ours = get_optimizer(CONFIG, odd_model, {})
    soap_groups = [g for g in ours.param_groups if g["optimizer"] == "soap"]
    assert [n for g in soap_groups for n in g["param_names"]] == [
        "layers.0.qkv.weight", "layers.0.proj.weight", "layers.1.qkv.weight", "layers.1.proj.weight",
    ]  # fmt: skip
    by_name = dict(reference_model.named_parameters())
    reference = SOAP(
        [{"params": [by_name[n] for n in g["param_names"]]} for g in soap_groups],
        lr=3e-3, betas=(0.9, 0.95), shampoo_beta=0.9, eps=1e-8, weight_decay=0.1, use_kl_shampoo=True,
    )
    generator_a, generator_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(20):
        fill_grads(list(odd_model.parameters()), generator_a)
        fill_grads(list(reference_model.parameters()), generator_b)
        ours.step()
        with torch._dynamo.config.patch(disable=True):  # upstream uncompiled: what optzoo runs for CPU params
            reference.step()
    for group in soap_groups:
        for name, param in zip(group["param_names"], group["params"]):
            torch.testing.assert_close(param, by_name[name], atol=0, rtol=0, msg=name)


def test_non_matrices_and_embeddings_go_to_the_scalar_optimizer(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(CONFIG.replace(muon_scalar_optimizer="lion"), gpt)
    by_name = {n: g for g in opt.param_groups for n in g["param_names"]}
    assert by_name["decoder.layers.0.mlp.linear_fc1.weight"]["optimizer"] == "soap"
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.bias"):
        assert by_name[name]["optimizer"] == "lion", name
    assert by_name["decoder.final_layernorm.bias"]["weight_decay"] == 0.0  # the standard no-decay rule still applies


def test_a_rule_may_route_an_embedding_to_soap_but_not_a_vector(gpt: torch.nn.Module) -> None:
    opt = get_optimizer(CONFIG, gpt, {ParamKey(name="embedding.word_embeddings.weight"): {"optimizer": "soap"}})
    by_name = {n: g for g in opt.param_groups for n in g["param_names"]}
    assert by_name["embedding.word_embeddings.weight"]["optimizer"] == "soap"
    with pytest.raises(ValueError, match=(
        r"`decoder.layers.0.input_layernorm.weight` \(1-D, shape \(16,\), norm \(forward: a normalisation's weight or bias\); "
        r"elementwise \(forward: native_layer_norm\)\): routed to soap by rule #0 "
        r"name='\*layernorm\*'; got a param soap does not take \(2-D only\); expected it routed to another optimizer, e.g. 'adam'"
    )):  # fmt: skip
        get_optimizer(CONFIG, gpt, {ParamKey(name="*layernorm*"): {"optimizer": "soap"}})


def test_precondition_frequency_other_than_one_is_refused(gpt: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"`OptimizerConfig.soap_precondition_frequency`: emerging-optimizers 0.3.0's SOAP refreshes its preconditioner every step; got 10; expected 1"):
        get_optimizer(CONFIG.replace(soap_precondition_frequency=10), gpt)


def test_soap_trains_inside_the_bf16_wrapper() -> None:
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(CONFIG.replace(bf16=True), model)
    losses = []
    batch = tokens()
    for _ in range(15):
        opt.zero_grad()
        loss = model.loss(batch)
        loss.backward()
        assert opt.step()[0]
        losses.append(loss.item())
    assert losses[-1] < losses[0]
