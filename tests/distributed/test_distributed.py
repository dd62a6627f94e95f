"""The distributed optimizers on real processes (gloo, CPU) against the single-process run.

Every rank builds the same tiny GPT from the same seed. Unless a test says DDP, every rank feeds
the whole batch, so gradients agree bit for bit across ranks and the single-process run is an
exact reference: Adam (element-wise, each element stepped by exactly one rank with the same
arithmetic) must match it bitwise. Where torch DDP averages gradients across ranks, or Muon's
batches differ in composition, results agree to float32 rounding instead.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from optzoo import OptimizerConfig, get_optimizer, resolve_group_configs
from optzoo.distributed import DistributedOptimizer, load_dcp, plan_shards, save_dcp
from tests.conftest import tiny_gpt
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

ADAM = {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.1}
MUON = {"optimizer": "muon", "lr": 1e-2, "weight_decay": 0.1}
LAYER_WISE = {"use_layer_wise_distributed_optimizer": True}
SHARDED = {"use_distributed_optimizer": True}
# DDP sums gradients in another order, and Muon's per-rank batches differ from the single
# process's; float32 rounding (~1e-7 relative) grows over the steps to about 1e-6.
ROUNDING = {"atol": 1e-5, "rtol": 1e-5}
# Where results agree only to rounding, Adam's eps is raised: the key part of the QKV bias has an
# exactly-zero true gradient (softmax ignores it), so its float gradient is ~1e-9 noise, and with
# eps=1e-8 Adam turns any rounding of that noise into a different +-lr step.
NOISE_TOLERANT = {"adam_eps": 1e-3}


def build(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = tiny_gpt()
    if extra:
        model.register_parameter("extra", nn.Parameter(torch.zeros(3)))
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(32, (8, 9), generator=torch.Generator().manual_seed(100 + step))


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state plus fp32 main copies held by this rank."""
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    mains = [entry.main for entry in optimizer.param_map.local if not entry.aliased]  # type: ignore[attr-defined]
    return state + sum(t.numel() * t.element_size() for t in mains)


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train per ``spec``; runs on every rank (``world == 0``: plain single process)."""
    model = build(extra=spec.get("extra_on_rank") == rank)
    if spec.get("bf16"):
        model = model.to(torch.bfloat16)
    config = OptimizerConfig(**spec["config"], bf16=bool(spec.get("bf16")))
    optimizer = get_optimizer(config, model, **spec.get("kwargs", {}))
    forward: nn.Module = DistributedDataParallel(model) if spec.get("ddp") else model
    if "load" in spec:
        model.load_state_dict(torch.load(spec["load"])["model"])
        optimizer.load_state_dict(torch.load(spec["load"], weights_only=False)["optimizer"])
    if "load_dcp" in spec:
        model.load_state_dict(torch.load(Path(spec["load_dcp"]) / "model.pt"))
        load_dcp(optimizer, spec["load_dcp"])  # type: ignore[arg-type]
    results = []
    for step in range(spec.get("start", 0), spec.get("start", 0) + spec["steps"]):
        tokens = batch(step)
        if spec.get("ddp"):
            tokens = tokens.chunk(world)[rank]
        optimizer.zero_grad()
        lm_loss(forward, tokens).backward()
        if spec.get("inf_on_rank") == rank and step == spec.get("start", 0):
            owned = optimizer.param_groups[0]["param_names"][0]
            dict(model.named_parameters())[owned].grad.view(-1)[0] = float("inf")  # type: ignore[union-attr]
        if spec.get("on_device"):
            success, norm, zeros = optimizer.step_on_device()  # type: ignore[attr-defined]
            results.append((bool(success), None if norm is None else float(norm), zeros))
        else:
            results.append(optimizer.step())
    out: dict[str, Any] = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "results": results,
        "state_bytes": state_bytes(optimizer),
    }
    if "save" in spec:
        state = optimizer.state_dict()  # a collective: every rank calls it
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": state}, spec["save"])
    if "save_dcp" in spec:
        save_dcp(optimizer, spec["save_dcp"])  # type: ignore[arg-type]
        if rank == 0:
            torch.save(model.state_dict(), Path(spec["save_dcp"]) / "model.pt")
    if isinstance(optimizer, DistributedOptimizer):
        out["loads"] = optimizer.plan.loads()
        out["owned"] = [s.name for s in optimizer.plan.owned(optimizer.rank)]
        out["state_elements"] = optimizer.plan.state_elements()
    return out


def single(spec: dict[str, Any]) -> dict[str, Any]:
    """The reference run, in this process, with one thread as each rank has."""
    with one_thread():
        return train(0, 0, spec)


def assert_params_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        if tolerance:
            torch.testing.assert_close(got[name], expected[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")
        else:
            assert torch.equal(got[name], expected[name]), name


# ---- plans (no processes) -------------------------------------------------------------------


def test_layer_wise_plan_balances_newton_schulz_cost_and_covers_every_param_once() -> None:
    groups, _ = resolve_group_configs(OptimizerConfig(**MUON), [build()], None)
    plan = plan_shards(groups, 2, "layer_wise")
    names = [n for g in groups for n in g.param_names]
    assert sorted(s.name for s in plan.shards) == sorted(names)
    assert all(s.whole for s in plan.shards)
    loads = plan.loads()
    biggest = max(s.cost for s in plan.shards)
    assert max(loads) - min(loads) <= biggest  # greedy by cost: within one param of even
    assert plan == plan_shards(groups, 2, "layer_wise")  # deterministic


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_plan_splits_element_wise_params_evenly(world: int) -> None:
    groups, _ = resolve_group_configs(OptimizerConfig(**ADAM), [build()], None)
    plan = plan_shards(groups, world, "sharded")
    total = sum(r.param.numel() for g in groups for r in g.params)
    assert plan.state_elements() == [total * (r + 1) // world - total * r // world for r in range(world)]
    for group in groups:
        for routed, name in zip(group.params, group.param_names):
            ranges = sorted((s.start, s.stop) for s in plan.shards if s.name == name)
            assert ranges[0][0] == 0 and ranges[-1][1] == routed.param.numel()
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap


def test_bad_plan_mode_and_a_plain_optimizer_for_dcp_are_refused() -> None:
    groups, _ = resolve_group_configs(OptimizerConfig(**ADAM), [build()], None)
    with pytest.raises(ValueError, match=r"^`mode`: unknown value; got 'zero'; expected 'layer_wise' or 'sharded'$"):
        plan_shards(groups, 2, "zero")  # type: ignore[arg-type]
    plain = get_optimizer(OptimizerConfig(**ADAM), build())
    with pytest.raises(TypeError, match=r"^`save_dcp`: needs a distributed optimizer; got FP32Optimizer; "):
        save_dcp(plain, "unused")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^`load_dcp`: needs a distributed optimizer; got FP32Optimizer; "):
        load_dcp(plain, "unused")  # type: ignore[arg-type]


def test_without_an_initialised_process_group_the_flags_fail_fast() -> None:
    for flag in ("use_distributed_optimizer", "use_layer_wise_distributed_optimizer"):
        with pytest.raises(ValueError) as error:
            get_optimizer(OptimizerConfig(**ADAM, **{flag: True}), build())
        assert str(error.value) == (
            f"`{flag}`: needs torch.distributed; got no initialised process group; expected "
            "torch.distributed.init_process_group(...) first (e.g. under torchrun), or the flag False"
        )


# ---- parity with one process ----------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_layer_wise_and_sharded_adam_equal_one_process_bitwise(world: int) -> None:
    expected = single({"config": ADAM, "steps": 3})
    for flags in (LAYER_WISE, SHARDED):
        runs = run_ranks(world, train, {"config": {**ADAM, **flags}, "steps": 3})
        for run in runs:
            assert_params_equal(run["params"], expected["params"])
        if flags is SHARDED:  # each rank holds about 1/world of the state
            assert all(abs(run["state_bytes"] * world / expected["state_bytes"] - 1) < 0.01 for run in runs)
        else:
            assert sum(run["state_bytes"] for run in runs) == expected["state_bytes"]


def test_clipping_uses_the_norm_over_every_rank() -> None:
    """Each rank sums its own squares and the sums are all-reduced: the same norm up to the order
    of the float32 sum, so the clip factor, and hence the params, agree to rounding."""
    config = {**ADAM, **NOISE_TOLERANT, "clip_grad": 0.05, "log_num_zeros_in_grad": True}
    expected = single({"config": config, "steps": 3})
    for flags in (LAYER_WISE, SHARDED):
        for run in run_ranks(2, train, {"config": {**config, **flags}, "steps": 3}):
            assert_params_equal(run["params"], expected["params"], **ROUNDING)
            for (ok, norm, _), (_, want_norm, _) in zip(run["results"], expected["results"]):
                assert ok and norm == pytest.approx(want_norm, rel=1e-6)
            # exact zeros on the first step (later, rounding-level drift can make or unmake a zero)
            assert run["results"][0][2] == expected["results"][0][2] > 0


def test_layer_wise_muon_with_ddp_equals_one_process() -> None:
    config = {**MUON, **NOISE_TOLERANT}
    expected = single({"config": config, "steps": 4})
    runs = run_ranks(2, train, {"config": {**config, **LAYER_WISE}, "steps": 4, "ddp": True})
    for run in runs:
        assert_params_equal(run["params"], expected["params"], **ROUNDING)
    assert_params_equal(runs[0]["params"], runs[1]["params"])  # every rank holds the same params
    owned = [set(run["owned"]) for run in runs]
    assert owned[0] and owned[1] and not owned[0] & owned[1]


def test_sharded_bf16_keeps_main_params_for_its_shard_only() -> None:
    spec = {"config": {**ADAM, **SHARDED}, "steps": 3, "bf16": True, "kwargs": {"param_sync": "broadcast"}}
    expected = single({**spec, "config": ADAM})
    runs = run_ranks(2, train, spec)
    for run in runs:
        assert_params_equal(run["params"], expected["params"])
        assert all(p.dtype == torch.bfloat16 for p in run["params"].values())


ZOO = {
    "sgd": ({"optimizer": "sgd", "lr": 1e-2, "sgd_momentum": 0.9, "weight_decay": 0.1}, {}),
    "lion": ({"optimizer": "lion", "lr": 1e-3, "weight_decay": 0.1}, {}),
    "soap": ({"optimizer": "soap", "lr": 1e-2, **NOISE_TOLERANT}, ROUNDING),
    "adaptive_muon": ({"optimizer": "adaptive_muon", "lr": 1e-2, **NOISE_TOLERANT}, ROUNDING),
    "rekls": ({"optimizer": "rekls", "lr": 1e-2, **NOISE_TOLERANT}, ROUNDING),
    "psgd_pro": ({"optimizer": "psgd_pro", "lr": 1e-2, "weight_decay": 0.1}, {}),  # its noise is seeded by param name and step
    "oblique_sgd": ({"optimizer": "oblique_sgd", "lr": 1e-2, "weight_decay": 0.1}, {}),
    "oblique_adam": ({"optimizer": "oblique_adam", "lr": 1e-2, "oblique_adam_dim": 1}, {}),
    "adam bf16": ({**ADAM, "bf16": True}, {}),
    "adam precision-aware": ({**ADAM, "bf16": True, "use_precision_aware_optimizer": True, "exp_avg_dtype": torch.bfloat16}, {}),
}


def train_zoo(rank: int, world: int) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Every entry of ZOO under both flags, in one spawned run."""
    runs: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for name, (config, _) in ZOO.items():
        bf16 = config.get("bf16", False)
        base = {k: v for k, v in config.items() if k != "bf16"}
        for mode, flags in (("layer_wise", LAYER_WISE), ("sharded", SHARDED)):
            runs.setdefault(name, {})[mode] = train(rank, world, {"config": {**base, **flags}, "steps": 3, "bf16": bf16})["params"]
    return runs


def test_every_optimizer_of_the_zoo_under_both_flags_equals_one_process() -> None:
    """Element-wise optimizers bitwise (bf16 and precision-aware Adam included); SOAP and
    Adaptive Muon to rounding (their matrices are batched differently per rank)."""
    runs = run_ranks(2, train_zoo)
    for name, (config, tolerance) in ZOO.items():
        bf16 = config.get("bf16", False)
        base = {k: v for k, v in config.items() if k != "bf16"}
        expected = single({"config": base, "steps": 3, "bf16": bf16})["params"]
        for run in runs:
            for mode in ("layer_wise", "sharded"):
                assert_params_equal(run[name][mode], expected, **tolerance)


def test_inf_on_one_rank_skips_the_step_on_every_rank() -> None:
    spec = {"config": {**ADAM, **LAYER_WISE}, "steps": 2, "inf_on_rank": 1}
    runs = run_ranks(2, train, spec)
    expected = single({"config": ADAM, "steps": 1, "start": 1})  # step 0 skipped: only step 1 lands
    for run in runs:
        assert run["results"][0] == (False, None, None)
        assert run["results"][1][0]
        assert_params_equal(run["params"], expected["params"])


def test_step_on_device_on_every_rank_equals_step_and_skips_an_inf_on_one_rank_everywhere() -> None:
    expected = single({"config": ADAM, "steps": 3})
    skipped = single({"config": ADAM, "steps": 1, "start": 1})  # step 0 skipped: only step 1 lands
    for flags in (LAYER_WISE, SHARDED):
        for run in run_ranks(2, train, {"config": {**ADAM, **flags}, "steps": 3, "on_device": True}):
            assert [ok for ok, _, _ in run["results"]] == [True] * 3
            assert_params_equal(run["params"], expected["params"])
    # layer-wise: rank 1 owns the param it poisons (sharded, element 0 is rank 0's)
    for run in run_ranks(2, train, {"config": {**ADAM, **LAYER_WISE}, "steps": 2, "inf_on_rank": 1, "on_device": True}):
        assert [ok for ok, _, _ in run["results"]] == [False, True]
        assert_params_equal(run["params"], skipped["params"])


def train_in_pairs(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Two data-parallel groups of 2 ranks ({0, 1}, {2, 3}), passed as Megatron's pg_collection."""
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    collection = SimpleNamespace(dp=pairs[rank // 2])
    spec = {"config": {**ADAM, **SHARDED}, "steps": 2, "kwargs": {"pg_collection": collection}}
    out = train(rank, world, spec)
    return {"params": out["params"], "state_elements": out["state_elements"]}  # type: ignore[dict-item]


def test_a_data_parallel_subgroup_from_pg_collection() -> None:
    runs = run_ranks(4, train_in_pairs)
    expected = single({"config": ADAM, "steps": 2})
    for run in runs:
        assert_params_equal(run["params"], expected["params"])  # type: ignore[arg-type]
    # sharded over the 2 ranks of each pair, not over the 4 of the world
    assert all(len(run["state_elements"]) == 2 for run in runs)


def test_pg_collection_without_a_data_parallel_group_is_refused() -> None:
    with pytest.raises(ValueError) as error:
        get_optimizer(OptimizerConfig(**ADAM, **SHARDED), build(), pg_collection=SimpleNamespace(tp=None))
    assert str(error.value) == (
        "`pg_collection`: has no data-parallel process group; got SimpleNamespace with dp_cp/dp = None; "
        "expected a torch.distributed.ProcessGroup in `dp_cp` or `dp`"
    )


# ---- checkpoints ----------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [LAYER_WISE, SHARDED], ids=["layer_wise", "sharded"])
def test_checkpoint_reshards_2_to_4_to_1_and_training_continues_bitwise(flags: dict[str, bool], tmp_path: Path) -> None:
    expected = single({"config": ADAM, "steps": 6})
    run_ranks(2, train, {"config": {**ADAM, **flags}, "steps": 2, "save": str(tmp_path / "a.pt")})
    run_ranks(4, train, {"config": {**ADAM, **flags}, "steps": 2, "start": 2, "load": str(tmp_path / "a.pt"), "save": str(tmp_path / "b.pt")})  # fmt: skip
    final = single({"config": ADAM, "steps": 2, "start": 4, "load": str(tmp_path / "b.pt")})
    assert_params_equal(final["params"], expected["params"])
    # the consolidated checkpoint is what one process would have saved after 4 steps
    four = get_optimizer(OptimizerConfig(**ADAM), build())
    four.load_state_dict(torch.load(tmp_path / "b.pt", weights_only=False)["optimizer"])


def test_dcp_checkpoint_saved_by_2_ranks_loads_on_4(tmp_path: Path) -> None:
    config = {**MUON, **NOISE_TOLERANT, **SHARDED}  # Muon matrices owned whole, Adam params sharded
    expected = single({"config": {**MUON, **NOISE_TOLERANT}, "steps": 4})
    run_ranks(2, train, {"config": config, "steps": 2, "save_dcp": str(tmp_path / "dcp")})
    runs = run_ranks(4, train, {"config": config, "steps": 2, "start": 2, "load_dcp": str(tmp_path / "dcp")})
    for run in runs:
        assert_params_equal(run["params"], expected["params"], **ROUNDING)


# ---- mismatched setups fail fast ------------------------------------------------------------


def check_mismatch(rank: int, world: int) -> str:
    try:
        train(rank, world, {"config": {**ADAM, **LAYER_WISE}, "steps": 1, "extra_on_rank": 1})
    except ValueError as error:
        return str(error)
    return "no error"


def test_different_params_on_different_ranks_fail_on_every_rank() -> None:
    messages = run_ranks(2, check_mismatch)
    assert messages[0].startswith("distributed optimizer: rank 1 resolved different parameters than rank 0; got only on rank 1: [(")
    assert "'extra', (3,), 'torch.float32')" in messages[0]
    assert messages[1].startswith("distributed optimizer: rank 0 resolved different parameters than rank 1; got only on rank 0: []")


def load_other_model(rank: int, world: int, path: str) -> str:
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = get_optimizer(OptimizerConfig(**ADAM, **SHARDED), model)
    try:
        optimizer.load_state_dict(torch.load(path, weights_only=False)["optimizer"])
    except ValueError as error:
        return str(error)
    return "no error"


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    run_ranks(2, train, {"config": {**ADAM, **SHARDED}, "steps": 1, "save": str(tmp_path / "a.pt")})
    messages = run_ranks(2, load_other_model, str(tmp_path / "a.pt"))
    assert messages[0] == messages[1]
    assert messages[0].startswith("`state_dict`: parameter names do not match this model; got names only in the checkpoint: [")
    assert messages[0].endswith("expected also: [0.bias, 0.weight] (only in this model)")

