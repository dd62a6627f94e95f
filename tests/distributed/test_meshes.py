"""FSDP2 on 2-D meshes (4 gloo ranks): HSDP (replicate x shard), FSDP x TP (``parallelize_module``
then ``fully_shard(mesh=mesh["dp"])``) and EP x FSDP, on optzoo's GPT and Hugging Face models.

Gradients are set directly (:func:`tests.distributed.meshes.set_grads`: each rank gets its piece
of one whole gradient), so every run compares with one process stepping the whole gradients. The
grad norm and the zero count are checked against float64 / exact counts computed here from the
whole gradients: a replica (HSDP's replicate dim, a LayerNorm every tp rank holds) counts once.
One spawn runs every layout and config (a spawn costs seconds on 2 cores).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, get_optimizer
from tests.distributed import meshes
from tests.distributed.harness import one_thread, run_ranks

pytestmark = pytest.mark.slow

STEPS = 3
BASE = OptimizerConfig(lr=1e-2, weight_decay=0.1, log_num_zeros_in_grad=True, clip_grad=0.0)  # Megatron's default clips at 1.0
CONFIGS: dict[str, OptimizerConfig] = {
    "adamw": BASE.replace(optimizer="adam"),
    "adamw-clip": BASE.replace(optimizer="adam", clip_grad=0.5),  # the grads' norms are ~30: always active
    "muon": BASE.replace(optimizer="muon", muon_fsdp_orthogonalize="redundant"),
    "muon-clip": BASE.replace(optimizer="muon", muon_fsdp_orthogonalize="redundant", clip_grad=0.5),
    "adaptive_muon-clip": BASE.replace(
        optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon", muon_fsdp_orthogonalize="redundant", clip_grad=0.5
    ),
    # owner-computes (issue 27): each matrix once across the mesh
    "muon-owner": BASE.replace(optimizer="muon", muon_fsdp_orthogonalize="owner", muon_tp_mode="layer_sharded"),
    "muon-owner-clip": BASE.replace(optimizer="muon", muon_fsdp_orthogonalize="owner", muon_tp_mode="layer_sharded", clip_grad=0.5),
    "adaptive_muon-owner-clip": BASE.replace(
        optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon", muon_fsdp_orthogonalize="owner",
        muon_tp_mode="layer_sharded", clip_grad=0.5,
    ),
    "muon-default": BASE.replace(optimizer="muon"),  # auto and auto: distributed for a TP matrix above an even share
    "adaptive_muon-default-clip": BASE.replace(optimizer="adaptive_muon", adaptive_muon_moment2_method="normuon", clip_grad=0.5),
    # AdaMuon's element-wise normalisation turns a 1-ulp change of the grads into ~4e-5 in the params
    # after 3 steps (measured in one process), so it is compared without clipping, whole matrices: bitwise
    "adaptive_muon-owner": BASE.replace(optimizer="adaptive_muon", muon_fsdp_orthogonalize="owner", muon_tp_mode="layer_sharded"),
}
LAYOUTS: dict[str, tuple[str, str]] = {
    "gpt-hsdp": ("gpt", "hsdp"),
    "gpt-fsdp-tp": ("gpt", "fsdp_tp"),
    "llama-hsdp": ("llama", "hsdp"),
    "llama-fsdp-tp": ("llama", "fsdp_tp"),
    "qwen3moe-ep-fsdp": ("qwen3_moe", "ep_fsdp"),
}
INF_RANK = 3
"""Holds replicas only in every layout here (HSDP's second replica; under FSDP x TP, the dp sub-mesh
pieces rank 2 holds too): an inf there must skip the step although that rank's norm share is left out."""


def _build(model_name: str) -> torch.nn.Module:
    return getattr(meshes, model_name)()  # type: ignore[no-any-return]


def _shard(model: torch.nn.Module, model_name: str, layout: str) -> None:
    if layout == "hsdp":
        meshes.hsdp(model, 2, 2)
    elif layout == "fsdp_tp":
        meshes.fsdp_tp(model, 2, 2, meshes.GPT_TP_PLAN if model_name == "gpt" else meshes.LLAMA_TP_PLAN)
    else:
        meshes.ep_fsdp(model, 2, 2)


def _grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Whole gradients with exact zeros (about 16% of the elements), so the zero count means something."""
    grads = meshes.reference_grads(model, 100 + step)
    return {name: torch.where(grad > 1.0, torch.zeros_like(grad), grad) for name, grad in grads.items()}


def _local_snapshot(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    from optzoo._common import local_shard

    tensors = [local_shard(p).detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [local_shard(v).clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, float]]:
    """Matrices this process orthogonalises while inside: whole ones (``newton_schulz``) and TP blocks
    (``newton_schulz_sharded``), each block counting as its share of one matrix."""
    import torch.distributed as dist

    import optzoo.optimizers.muon as muon_module
    import optzoo.optimizers.owner_compute as owner_compute

    counts = {"whole": 0.0, "blocks": 0.0}
    whole, sharded = muon_module.newton_schulz, owner_compute.newton_schulz_sharded

    def counting_whole(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        counts["whole"] += x.shape[0] if x.dim() == 3 else 1
        return whole(x, **kwargs)

    def counting_blocks(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        counts["blocks"] += x.shape[0] / dist.get_world_size(kwargs["group"])
        return sharded(x, **kwargs)

    muon_module.newton_schulz, owner_compute.newton_schulz_sharded = counting_whole, counting_blocks  # type: ignore[assignment]
    try:
        yield counts
    finally:
        muon_module.newton_schulz, owner_compute.newton_schulz_sharded = whole, sharded  # type: ignore[assignment]


def _parity_runs(rank: int, world: int, layouts: list[str], configs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout_name in layouts:
        model_name, layout = LAYOUTS[layout_name]
        for config_name in configs:
            config = CONFIGS[config_name]
            model = _build(model_name)
            _shard(model, model_name, layout)
            optimizer = get_optimizer(config, model, lint=False, trace=False)
            reference = _build(model_name)
            steps = []
            for step in range(STEPS):
                meshes.set_grads(model, _grads(reference, step))
                with _counting() as orthogonalised:
                    ok, norm, zeros = optimizer.step()
                if norm is None:  # not clipping: step() returns no norm (Megatron's); get_grad_norm() reads it
                    norm = optimizer.get_grad_norm()
                steps.append((ok, norm, zeros))
            params = meshes.full_params(model)
            # An inf on one rank's (replica) piece: every rank skips, nothing changes.
            grads = _grads(reference, STEPS)
            meshes.set_grads(model, grads)
            before = _local_snapshot(model, optimizer)
            if rank == INF_RANK:
                first = next(p for name, p in model.named_parameters() if name.endswith("norm.weight"))
                first.grad.to_local().view(-1)[0] = float("inf")  # type: ignore[union-attr]
            skipped = optimizer.step()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, _local_snapshot(model, optimizer), strict=True))
            out[f"{layout_name}/{config_name}"] = {
                "steps": steps, "params": params if rank == 0 else None, "skipped": skipped[0], "unchanged": unchanged,
                "orthogonalised": orthogonalised,
            }  # fmt: skip
    return out


def _repointed(rank: int) -> dict[str, Any]:
    """accelerate's order: the optimizer built on the plain model, then the model sharded (HSDP 2x2)
    and ``param_groups`` re-pointed at the new params by name (``fsdp2_switch_optimizer_parameters``)."""
    model = meshes.gpt()
    optimizer = get_optimizer(CONFIGS["adamw"], model, lint=False, trace=False)
    meshes.hsdp(model, 2, 2)
    params = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params[name] for name in group["param_names"]]
    steps = []
    for step in range(STEPS):
        meshes.set_grads(model, _grads(meshes.gpt(), step))
        ok, _, zeros = optimizer.step()
        steps.append((ok, optimizer.get_grad_norm(), zeros))
    return {"steps": steps, "params": meshes.full_params(model)}


def _refusals(rank: int) -> dict[str, str]:
    """What no group can serve, refused by name on every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from optzoo.distributed import mesh_process_group, replicated_params

    out: dict[str, str] = {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    partial = torch.nn.Linear(4, 4)
    partial.weight = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh, [Partial()], run_check=False))
    with pytest.raises(ValueError) as error:
        get_optimizer(BASE, partial, lint=False, trace=False)
    out["partial"] = str(error.value)
    left, right = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1, 2])  # every rank builds both: new_group is collective
    two = [("left.weight", distribute_tensor(torch.ones(4, 4), left, [Shard(0)]), False)]
    two.append(("right.weight", distribute_tensor(torch.ones(4, 4), right, [Shard(0)]), False))
    with pytest.raises(ValueError) as error:
        mesh_process_group(two)
    out["unrelated"] = str(error.value)
    whole = torch.ones(8, 4)
    overlapping = [("w", distribute_tensor(whole, mesh, [Shard(0)]), False), ("w", distribute_tensor(whole, mesh, [Replicate()]), False)]
    with pytest.raises(ValueError) as error:
        replicated_params(overlapping, mesh.get_group())
    out["overlap"] = str(error.value)
    return out


def _mesh_runs(rank: int, world: int, layouts: list[str], configs: list[str]) -> dict[str, Any]:
    return {"parity": _parity_runs(rank, world, layouts, configs), "repointed": _repointed(rank), "refusals": _refusals(rank)}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    with one_thread():
        return run_ranks(4, _mesh_runs, list(LAYOUTS), list(CONFIGS), timeout=900)


@pytest.fixture(scope="module")
def parity(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run["parity"] for run in runs]


def _expected_norms_and_zeros(model_name: str, steps: int) -> list[tuple[float, int]]:
    """Float64 norm and exact zero count of each step's whole gradients, computed here."""
    reference = _build(model_name)
    out = []
    for step in range(steps):
        grads = _grads(reference, step)
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        out.append((norm, sum(int((g == 0).sum()) for g in grads.values())))
    return out


def test_repointed_params_on_a_2d_mesh_are_followed(runs: list[dict[str, Any]]) -> None:
    """accelerate's prepare order onto HSDP 2x2: the re-pointing is followed (the group spans the
    mesh), replicas count once, and the params equal one process's to a few ulps (AdamW, no clipping)."""
    expected = _expected_norms_and_zeros("gpt", STEPS)
    for run in runs:
        for (ok, norm, zeros), (expected_norm, expected_zeros) in zip(run["repointed"]["steps"], expected, strict=True):
            assert ok and zeros == expected_zeros
            assert norm == pytest.approx(expected_norm, rel=1e-6)
    single = _one_process("gpt", CONFIGS["adamw"])
    worst = max(float((runs[0]["repointed"]["params"][name] - value).abs().max()) for name, value in single.items())
    # Re-pointed DTensor groups step with foreach Adam (torch's fused CPU kernel has no DTensor rule for
    # every case), one process with fused Adam: other roundings, a few ulps after 3 steps.
    assert worst <= 5e-7, worst


def test_what_no_group_serves_is_refused_by_name(runs: list[dict[str, Any]]) -> None:
    """Partial placements, meshes of unrelated roots, and pieces that do not tile their param."""
    for rank, run in enumerate(runs):
        refusals = run["refusals"]
        assert refusals["partial"].startswith(
            "`model_chunks`: a DTensor param has a placement the optimizer cannot step; got `weight` with placements "
            "(Partial(sum),) on mesh () [0, 1, 2, 3]; expected Shard, _StridedShard or Replicate on each mesh dim"
        ), refusals["partial"]
        assert refusals["unrelated"].startswith(
            "`model_chunks`: DTensor params lie on unrelated device meshes; got root meshes over ranks [0, 1] "
            "(first: `left.weight` with placements (Shard(dim=0),) on mesh () [0, 1]); ranks [1, 2] "
            "(first: `right.weight` with placements (Shard(dim=0),) on mesh () [1, 2]); expected every mesh sliced from one root mesh"
        ), (rank, refusals["unrelated"])
        assert refusals["overlap"].startswith(
            "`model_chunks`: the ranks' shards of a DTensor param do not tile it; got 64 distinct elements over the "
            "ranks for 32 in `w` with placements (Shard(dim=0),) on mesh () [0, 1, 2, 3] (e.g.)"
        ), refusals["overlap"]


def _one_process(model_name: str, config: OptimizerConfig, counts: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    with one_thread():
        model = _build(model_name)
        optimizer = get_optimizer(config, model, lint=False, trace=False)
        for step in range(STEPS):
            grads = _grads(_build(model_name), step)
            for name, param in model.named_parameters():
                param.grad = grads[name].clone()
            with _counting() as counted:
                assert optimizer.step()[0]
            if counts is not None:
                counts["whole"] = counts.get("whole", 0.0) + counted["whole"]
        return {name: param.detach().clone() for name, param in model.named_parameters()}


ATOL = {
    "adamw": 0.0, "muon": 0.0, "adamw-clip": 5e-7, "muon-clip": 5e-7, "adaptive_muon-clip": 5e-7,
    "muon-owner": 0.0, "muon-owner-clip": 5e-7, "adaptive_muon-owner-clip": 5e-7, "muon-default": 2e-6,
    "adaptive_muon-default-clip": 2e-6, "adaptive_muon-owner": 0.0,
}
"""Without clipping, bit for bit: AdamW is element-wise, so a shard steps as its part of the whole
tensor, and Muon (redundant) orthogonalises the gathered matrix, the one-process arithmetic (one
thread on each side). With clipping, the norm is summed in another order (per rank, then over
ranks), so the clip factor's last bit may differ; after 3 steps of lr 1e-2 the params then differ
by a few ulps (measured at most 1.2e-7, AdaptiveMuon's NorMuon included). Owner-computes
(``layer_sharded``) is the same arithmetic on the owner: bit for bit. The defaults may take
``distributed`` for a TP matrix (Newton–Schulz's sums over the TP group in another order:
within 2e-5 of one process's orthogonal matrix, times lr 1e-2 and the scale, over 3 steps)."""


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_nd_mesh_equals_one_process(layout_name: str, config_name: str, parity: list[dict[str, Any]]) -> None:
    """Params after 3 steps (:data:`ATOL`), the returned grad norm (float64 from the whole grads, rtol 1e-6: float32
    sums) and the zero count (exact) equal one process's; an inf on one rank skips every rank, with
    params and state unchanged bit for bit."""
    model_name, _ = LAYOUTS[layout_name]
    config = CONFIGS[config_name]
    for step, (expected_norm, expected_zeros) in enumerate(_expected_norms_and_zeros(model_name, STEPS)):
        for rank, run in enumerate(parity):
            ok, norm, zeros = run[f"{layout_name}/{config_name}"]["steps"][step]
            assert ok, (rank, step)
            assert norm == pytest.approx(expected_norm, rel=1e-6), (rank, step)
            assert zeros == expected_zeros, (rank, step)
    for rank, run in enumerate(parity):
        result = run[f"{layout_name}/{config_name}"]
        assert result["skipped"] is False and result["unchanged"], rank
    counts: dict[str, float] = {}
    expected = _one_process(model_name, config, counts)
    if "owner" in config_name or "default" in config_name:  # each matrix once across the mesh (a TP block: its share)
        across = [run[f"{layout_name}/{config_name}"]["orthogonalised"] for run in parity]
        # but for the GPT's position table under FSDP x TP: routed to Muon there (roles guessed,
        # trace=False) and left whole by TP, it lies on mesh["dp"], one slice per tp rank, and each
        # slice computes its copy (torch does not say slices hold the same values: an expert mesh's do
        # not); under the default `auto`, alone in its slice's group, it takes the redundant path
        # (one matrix: no work to share), so all 4 ranks compute it
        per_slice = (3 if "default" in config_name else 1) if layout_name == "gpt-fsdp-tp" else 0
        assert sum(c["whole"] + c["blocks"] for c in across) == counts["whole"] / STEPS + per_slice, across
    got = parity[0][f"{layout_name}/{config_name}"]["params"]
    worst = {name: float((got[name] - value).abs().max()) for name, value in expected.items()}
    assert max(worst.values()) <= ATOL[config_name], sorted(worst.items(), key=lambda kv: -kv[1])[:3]


# ---- checkpoints across mesh shapes ---------------------------------------------------------------

SAVED_AT = 2
"""Checkpoints are taken after this many steps; every run then takes step ``SAVED_AT + 1``."""
CHECKPOINT_CONFIGS = ["adamw", "muon"]  # no clipping: every run equals one process bit for bit


def _gpt(seed: int = 0) -> torch.nn.Module:
    """Hidden 64, so that every local shard on every mesh here is a multiple of 16 elements: torch's
    fused CPU Adam rounds ``exp_avg_sq`` by an ulp differently in a shard with a shorter vector tail
    (measured 1e-7 relative on a 12-element shard; foreach Adam is bitwise), which could reach the
    params. Aligned shards step exactly as one process, so the runs are compared bit for bit."""
    return meshes.gpt(hidden=64, seed=seed)


def _single(config_name: str) -> dict[str, Any]:
    """One process: the params and the consolidated state at the checkpoint, and the params one step later."""
    with one_thread():
        model = _gpt()
        optimizer = get_optimizer(CONFIGS[config_name], model, lint=False, trace=False)
        reference = _gpt()
        out: dict[str, Any] = {}
        for step in range(SAVED_AT + 1):
            if step == SAVED_AT:
                out["params"] = meshes.full_params(model)
                out["saved"] = copy.deepcopy(optimizer.state_dict())  # live tensors (``step``) move on
            meshes.set_grads(model, _grads(reference, step))
            assert optimizer.step()[0]
        out["continued"] = meshes.full_params(model)
        return out


def _continue(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """The step after the checkpoint, then every param whole."""
    meshes.set_grads(model, _grads(_gpt(), SAVED_AT))
    assert optimizer.step()[0]
    return meshes.full_params(model)


def _sharded(layout: str, params: dict[str, torch.Tensor], config_name: str) -> tuple[torch.nn.Module, Any]:
    """The GPT holding ``params``, sharded as ``layout`` (``"fsdp"``: 1-D over the world, ``"plain"``:
    not at all), with a fresh optimizer."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = _gpt(seed=1)  # other initial values: everything must come from ``params`` and the checkpoint
    model.load_state_dict(params)
    if layout == "fsdp":
        with meshes.preserve_param_attributes(model):
            meshes._fully_shard(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    elif layout != "plain":
        _shard(model, "gpt", layout)
    return model, get_optimizer(CONFIGS[config_name], model, lint=False, trace=False)


def _whole(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An FSDP2 optimizer's consolidated state dict (DTensor state) with whole tensors, as rank 0 would
    ``torch.save`` it for a process without the mesh (a collective: the DTensors are gathered)."""
    state = {name: {key: meshes.full(v) if isinstance(v, torch.Tensor) else v for key, v in values.items()} for name, values in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _checkpoints_4(rank: int, world: int, tmp: str, single: dict[str, Any]) -> dict[str, Any]:
    """4 ranks: 2x2 HSDP and FSDP2 x TP2 train to the checkpoint (saved consolidated and with DCP), and
    take one more step; both checkpoints load into 4-rank 1-D FSDP, which saves them again; one
    process's consolidated checkpoint and the 1-rank DCP one (if there) load into 2x2 and FSDP2 x TP2."""
    from optzoo.distributed import load_dcp, save_dcp

    out: dict[str, Any] = {}
    for config_name in CHECKPOINT_CONFIGS:
        at_save = single[config_name]["params"]
        if not os.path.exists(f"{tmp}/{config_name}-one"):
            for layout in ("hsdp", "fsdp_tp"):
                model = _gpt()
                _shard(model, "gpt", layout)
                optimizer = get_optimizer(CONFIGS[config_name], model, lint=False, trace=False)
                reference = _gpt()
                for step in range(SAVED_AT):
                    meshes.set_grads(model, _grads(reference, step))
                    assert optimizer.step()[0]
                out[f"{config_name}/{layout}/saved"] = _whole(optimizer.state_dict())  # consolidated: a collective
                save_dcp(optimizer, f"{tmp}/{config_name}-{layout}")
                out[f"{config_name}/{layout}/continued"] = _continue(model, optimizer)
            # 2x2 -> 4, consolidated, then saved again for one process; and with DCP
            model, optimizer = _sharded("fsdp", at_save, config_name)
            optimizer.load_state_dict(out[f"{config_name}/hsdp/saved"])
            out[f"{config_name}/2x2->4/saved"] = _whole(optimizer.state_dict())
            save_dcp(optimizer, f"{tmp}/{config_name}-fsdp4")
            out[f"{config_name}/2x2->4/continued"] = _continue(model, optimizer)
            model, optimizer = _sharded("fsdp", at_save, config_name)
            load_dcp(optimizer, f"{tmp}/{config_name}-hsdp")
            out[f"{config_name}/2x2->4 dcp/continued"] = _continue(model, optimizer)
        else:
            # 1 -> 2x2 and 1 -> FSDP2 x TP2: one process's consolidated state, and the 1-rank DCP checkpoint
            for layout in ("hsdp", "fsdp_tp"):
                model, optimizer = _sharded(layout, at_save, config_name)
                optimizer.load_state_dict(single[config_name]["saved"])
                out[f"{config_name}/1->{layout}/continued"] = _continue(model, optimizer)
                model, optimizer = _sharded(layout, at_save, config_name)
                load_dcp(optimizer, f"{tmp}/{config_name}-one")
                out[f"{config_name}/1->{layout} dcp/continued"] = _continue(model, optimizer)
    return out


def _checkpoints_1(rank: int, world: int, tmp: str, single: dict[str, Any]) -> dict[str, Any]:
    """1 rank (FSDP2 over a 1-rank mesh, as torchrun --nproc-per-node 1 runs it): load the 4-rank and
    the FSDP2 x TP2 DCP checkpoints, take the step; save one for the way back to 2x2."""
    from optzoo.distributed import load_dcp, save_dcp

    out: dict[str, Any] = {}
    for config_name in CHECKPOINT_CONFIGS:
        at_save = single[config_name]["params"]
        for source in ("fsdp4", "fsdp_tp"):
            model, optimizer = _sharded("fsdp", at_save, config_name)
            load_dcp(optimizer, f"{tmp}/{config_name}-{source}")
            if source == "fsdp4":
                save_dcp(optimizer, f"{tmp}/{config_name}-one")
            out[f"{config_name}/{source}->1 dcp/continued"] = _continue(model, optimizer)
    return out


def test_checkpoints_load_across_mesh_shapes(tmp_path: Any) -> None:
    """2x2 -> 4 -> 1 -> 2x2 and FSDP2 x TP2 -> 1 -> FSDP2 x TP2, consolidated (``state_dict``) and with
    ``save_dcp``/``load_dcp``, for AdamW and Muon (redundant): the step after every load equals one
    process's bit for bit (fp32, no clipping), and every consolidated checkpoint is one process's."""
    single = {name: _single(name) for name in CHECKPOINT_CONFIGS}
    with one_thread():
        saved = run_ranks(4, _checkpoints_4, str(tmp_path), single, timeout=900)[0]
        one_rank = run_ranks(1, _checkpoints_1, str(tmp_path), single)[0]
        back = run_ranks(4, _checkpoints_4, str(tmp_path), single, timeout=900)[0]
    continued = {**saved, **one_rank, **back}
    for config_name in CHECKPOINT_CONFIGS:
        expected = single[config_name]
        for key in ("fsdp_tp", "2x2->4"):  # -> 1 process, consolidated
            model, optimizer = _sharded("plain", expected["params"], config_name)
            optimizer.load_state_dict(saved[f"{config_name}/{key}/saved"])
            continued[f"{config_name}/{key}->1/continued"] = _continue(model, optimizer)
        runs = [key for key in continued if key.startswith(f"{config_name}/") and key.endswith("/continued")]
        assert len(runs) == 12, runs
        mismatches = [(key, name) for key in runs for name, value in expected["continued"].items() if not torch.equal(continued[key][name], value)]
        assert not mismatches, mismatches
        for key in ("hsdp", "fsdp_tp", "2x2->4"):
            _assert_same_state(saved[f"{config_name}/{key}/saved"], expected["saved"], f"{config_name}/{key}")


def _assert_same_state(got: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    assert set(got["state"]) == set(expected["state"]), where
    for name, values in expected["state"].items():
        assert set(got["state"][name]) == set(values), (where, name)
        for key, value in values.items():
            got_value, expected_value = meshes.full(got["state"][name][key]), meshes.full(value)
            assert torch.equal(got_value, expected_value), (where, name, key)
