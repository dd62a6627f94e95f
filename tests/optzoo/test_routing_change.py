"""Resume across a routing change (issue 28, item 2): a digest in every checkpoint, a refusal that names
the params whose routing changed, ``allow_routing_change`` and ``warm_start``.

Expectations are written by hand from the models' structure (which params a ``*.mlp.*`` rule moves),
compared against torch.optim's state for a fresh optimizer, and bitwise against the checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import subprocess
import sys
import warnings
from typing import Any

import pytest
import torch
import transformers

from optzoo import OptimizerConfig, ParamKey, RoutingChangeReport, RoutingChangeWarning, get_optimizer
from tests.conftest import tiny_gpt, tokens, twin

MUON = OptimizerConfig(lr=1e-2, optimizer="muon")
MLP_TO_ADAM = {ParamKey(name="*.mlp.*"): {"optimizer": "adam"}}
GPT_MLP_WEIGHTS = [f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in (0, 1) for j in (1, 2)]
GPT_MLP_BIASES = [f"decoder.layers.{i}.mlp.linear_fc{j}.bias" for i in (0, 1) for j in (1, 2)]
LLAMA_MLP = [f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up", "down")]
ADVICE = (
    "expected the routing it was saved with (or load_state_dict(..., allow_routing_change=True) to load what still "
    "fits and start these params fresh)"
)


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)  # type: ignore[no-any-return]


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if isinstance(model, transformers.PreTrainedModel):
        return model(input_ids=batch, labels=batch).loss  # type: ignore[no-any-return]
    return model.loss(batch)  # type: ignore[no-any-return, operator]


def _trained(model: torch.nn.Module, overrides: Any = None, steps: int = 2) -> tuple[torch.optim.Optimizer, dict[str, Any]]:
    opt = get_optimizer(MUON, model, overrides, lint=False)
    for _ in range(steps):
        opt.zero_grad()
        _loss(model, tokens()).backward()
        opt.step()
    return opt, _roundtrip(opt.state_dict())


def _by_name(opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Each param's state by name (cloned), through the param map."""
    return {
        e.name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[e.main].items()}
        for e in opt.param_map.entries  # type: ignore[attr-defined]
        if e.main is not None and opt.state.get(e.main)
    }


def _same(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            assert torch.equal(torch.as_tensor(a[name][key]), torch.as_tensor(b[name][key])), (name, key)


def test_the_same_routing_loads_bitwise_with_no_warning() -> None:
    model = tiny_gpt()
    opt, saved = _trained(model)
    other = get_optimizer(MUON, twin(model), lint=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        assert other.load_state_dict(saved) is None
    _same(_by_name(other), _by_name(opt))
    assert saved["routing_digest"] == other.routing_digest == opt.routing_digest  # type: ignore[attr-defined]


def test_the_digest_is_sha256_of_the_canonical_record_and_the_same_in_every_process() -> None:
    opt, saved = _trained(tiny_gpt(), steps=1)
    canonical = json.dumps(saved["routing"], sort_keys=True, separators=(",", ":"))
    assert saved["routing_digest"] == hashlib.sha256(canonical.encode()).hexdigest()
    record = saved["routing"]["params"]["decoder.layers.0.mlp.linear_fc1.weight"]
    assert record == {
        "shape": [64, 16], "group": 0, "optimizer": "muon",
        "precision": {"dtype": "float32", "grad": "shared", "fp32_main": False},
        "layout": {"flatten": False, "view": {"split": [64, 16], "origin": [0, 1], "blocks": [], "rows": [0], "cols": [1]}},
    }  # fmt: skip
    assert saved["routing"]["plan"] == "none"
    script = (
        "import torch; from optzoo import OptimizerConfig, get_optimizer; from tests.conftest import tiny_gpt; "
        "print(get_optimizer(OptimizerConfig(lr=1e-2, optimizer='muon'), tiny_gpt(), lint=False).routing_digest)"
    )
    for seed in ("1", "2"):  # another interpreter, another str hash seed
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.getcwd()}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, cwd=os.getcwd())
        assert out.stdout.strip() == saved["routing_digest"]


def test_a_precision_change_changes_the_digest() -> None:
    model = tiny_gpt()
    assert get_optimizer(MUON, model, lint=False).routing_digest != get_optimizer(MUON.replace(bf16=True), twin(model).to(torch.bfloat16), lint=False).routing_digest  # type: ignore[attr-defined]


def _refused_unchanged(opt: torch.optim.Optimizer, model: torch.nn.Module, saved: dict[str, Any], message: str) -> None:
    """The load raises exactly ``message`` and leaves params, state and groups bitwise as they were."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = _by_name(opt)
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError) as caught:
        opt.load_state_dict(saved)
    assert str(caught.value) == message
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    _same(_by_name(opt), state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups


def test_gpt_mlp_moved_from_muon_to_adam_is_refused_naming_the_params() -> None:
    model = tiny_gpt()
    _, saved = _trained(model)
    resumed = twin(model)
    opt, _ = _trained(resumed, MLP_TO_ADAM, steps=1)  # state of its own, which a refusal must keep
    # The rule moves the 4 MLP weights from Muon's group #0 to a new Adam group #3, and the 4 MLP
    # biases (adam either way) from the no-decay group #2 to their own group #4.
    moved = [f"{n}: group #0 muon -> group #3 adam" for n in GPT_MLP_WEIGHTS] + [f"{GPT_MLP_BIASES[0]}: group #2 adam -> group #4 adam"]
    message = f"`state_dict`: the routing (param group and optimizer) of 8 params differs from the checkpoint's; got {'; '.join(moved)}; ... (+3 more); {ADVICE}"
    _refused_unchanged(opt, resumed, saved, message)


def test_llama_mlp_moved_from_muon_to_adam_is_refused_naming_the_params() -> None:
    model = _llama()
    _, saved = _trained(model)
    resumed = twin(model)
    opt, _ = _trained(resumed, MLP_TO_ADAM, steps=1)
    # The norms' group is renumbered (#2 -> #3) but keeps its members: not a change.
    moved = [f"{n}: group #0 muon -> group #2 adam" for n in LLAMA_MLP[:5]]
    message = f"`state_dict`: the routing (param group and optimizer) of 6 params differs from the checkpoint's; got {'; '.join(moved)}; ... (+1 more); {ADVICE}"
    _refused_unchanged(opt, resumed, saved, message)


@pytest.mark.parametrize("build", [tiny_gpt, _llama], ids=["gpt", "llama"])
def test_allow_routing_change_starts_fresh_exactly_where_reported(build: Any) -> None:
    model = build()
    _, saved = _trained(model)
    fresh_names = GPT_MLP_WEIGHTS if build is tiny_gpt else LLAMA_MLP
    resumed, reference = twin(model), twin(model)
    opt = get_optimizer(MUON, resumed, MLP_TO_ADAM, lint=False)
    for group in saved["param_groups"]:
        group["lr"] = 0.5  # a scheduler's lr: restored only where a group kept its members
    with pytest.warns(RoutingChangeWarning) as caught:
        report = opt.load_state_dict(saved, allow_routing_change=True)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        f"`load_state_dict`: started {len(fresh_names)} params with fresh optimizer state, their routing having changed; "
        f"got [{', '.join(fresh_names)}]; expected nothing else to start fresh (the returned RoutingChangeReport lists them all)"
    )
    assert caught[0].filename == __file__  # points at the caller's load_state_dict
    assert isinstance(report, RoutingChangeReport)
    assert list(report.fresh) == fresh_names and report.converted == ()
    # GPT: Muon's #0 and the no-decay #2 lost members, #3 and #4 are new; only the embeddings' #1 kept its
    # members. Llama: Muon's #0 lost the MLP, #2 is new; #1 (embeddings) and the norms (#2 -> #3) kept theirs.
    assert [g["lr"] for g in opt.param_groups] == ([0.01, 0.5, 0.01, 0.01, 0.01] if build is tiny_gpt else [0.01, 0.5, 0.01, 0.5])
    # Every other param holds the checkpoint's state, bitwise (the GPT's MLP biases moved group but kept it).
    loaded = _by_name(opt)
    assert set(loaded) == set(saved["state"]) - set(fresh_names)
    _same(loaded, {n: v for n, v in saved["state"].items() if n not in fresh_names})
    # The fresh ones are as a new optimizer's: after one step on the same batch, torch's AdamW state.
    new = get_optimizer(MUON, reference, MLP_TO_ADAM, lint=False)
    batch = tokens()
    for m, o in ((resumed, opt), (reference, new)):
        o.zero_grad()
        _loss(m, batch).backward()
        o.step()
    after, expected = _by_name(opt), _by_name(new)
    _same({n: after[n] for n in fresh_names}, {n: expected[n] for n in fresh_names})
    assert {n: sorted(after[n]) for n in fresh_names} == {n: ["exp_avg", "exp_avg_sq", "step"] for n in fresh_names}
    assert all(float(after[n]["step"]) == 1.0 for n in fresh_names)


def test_warm_start_adam_to_muon_carries_exp_avg_into_the_momentum_buffer() -> None:
    model = tiny_gpt()
    _, saved = _trained(model, MLP_TO_ADAM)  # MLP weights on AdamW
    opt = get_optimizer(MUON, twin(model), lint=False)  # back to Muon
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing starts fresh: no warning
        report = opt.load_state_dict(saved, allow_routing_change=True, warm_start=True)
    assert isinstance(report, RoutingChangeReport)
    assert list(report.converted) == GPT_MLP_WEIGHTS and report.fresh == ()
    loaded = _by_name(opt)
    for name in GPT_MLP_WEIGHTS:
        assert list(loaded[name]) == ["momentum_buffer"]  # Muon keeps no step
        assert torch.equal(loaded[name]["momentum_buffer"], saved["state"][name]["exp_avg"])


def test_warm_start_muon_to_adam_carries_the_momentum_into_exp_avg() -> None:
    model = tiny_gpt()
    _, saved = _trained(model)  # MLP weights on Muon
    opt = get_optimizer(MUON, twin(model), MLP_TO_ADAM, lint=False)
    report = opt.load_state_dict(saved, allow_routing_change=True, warm_start=True)
    assert isinstance(report, RoutingChangeReport) and list(report.converted) == GPT_MLP_WEIGHTS
    loaded = _by_name(opt)
    for name in GPT_MLP_WEIGHTS:
        momentum = saved["state"][name]["momentum_buffer"]
        assert torch.equal(loaded[name]["exp_avg"], momentum)
        assert torch.equal(loaded[name]["exp_avg_sq"], momentum * momentum)
        assert float(loaded[name]["step"]) == 0.0


def test_warm_start_needs_allow_routing_change() -> None:
    model = tiny_gpt()
    _, saved = _trained(model, steps=1)
    opt = get_optimizer(MUON, twin(model), lint=False)
    with pytest.raises(ValueError, match=r"^`warm_start`: converts the state of params whose routing changed; got warm_start=True with allow_routing_change=False; expected allow_routing_change=True with it$"):
        opt.load_state_dict(saved, warm_start=True)


def test_an_old_checkpoint_without_a_digest_loads_with_one_warning() -> None:
    model = tiny_gpt()
    opt, saved = _trained(model)
    del saved["routing"], saved["routing_digest"]
    other = get_optimizer(MUON, twin(model), lint=False)
    with pytest.warns(RoutingChangeWarning) as caught:
        other.load_state_dict(saved)
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "`state_dict`: no routing digest; got a checkpoint saved before optzoo recorded one; expected `routing_digest`: "
        "its routing is compared by group membership and algorithm only (save it again to record one)"
    )
    assert caught[0].filename == __file__  # points at the caller's load_state_dict
    _same(_by_name(other), _by_name(opt))


def test_an_old_checkpoint_with_another_routing_is_still_refused_by_name() -> None:
    model = _llama()
    _, saved = _trained(model)
    del saved["routing"], saved["routing_digest"]
    resumed = twin(model)
    opt = get_optimizer(MUON, resumed, MLP_TO_ADAM, lint=False)
    moved = [f"{n}: group #0 muon -> group #2 adam" for n in LLAMA_MLP[:5]]
    with pytest.warns(RoutingChangeWarning):
        _refused_unchanged(opt, resumed, saved, f"`state_dict`: the routing (param group and optimizer) of 6 params differs from the checkpoint's; got {'; '.join(moved)}; ... (+1 more); {ADVICE}")
