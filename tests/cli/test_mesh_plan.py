"""``optzoo dump-param-groups --mesh``: Muon's FSDP2 owner-computes plan before launch.

Expectations are written by hand from the documented rules (docs/cli.md#the-owner-computes-plan):
owners by largest Newton–Schulz cost first to the least-loaded rank (ties: the lowest rank), the
nearest holder sending each piece, bytes counted from the boxes ``fully_shard`` gives each rank.
The placements themselves are checked against torch's own ``fully_shard`` and
``parallelize_module`` on a fake process group.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_cli import REPO_ROOT, run, run_error, run_usage_error, write_file, write_module  # noqa: F401 (a fixture)

MODEL = """
    import torch.nn as nn

    def build():
        model = nn.Module()
        model.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.linear_fc1 = nn.Linear(8, 8, bias=False)  # colwise by the default TP plan
            layer.linear_fc2 = nn.Linear(8, 8, bias=False)  # rowwise
            model.layers.append(layer)
        return model
"""
"""Four equal 8 x 8 matrices, Megatron names: ``layers.{0,1}.linear_fc{1,2}.weight``."""

MUON = """
    overrides = []

    [config]
    optimizer = "muon"
    lr = 0.02
    standard_overrides = false
"""

NAMES = ["layers.0.linear_fc1.weight", "layers.0.linear_fc2.weight", "layers.1.linear_fc1.weight", "layers.1.linear_fc2.weight"]
NS_FLOPS = 5 * 3 * 2 * 8**3
"""One 8 x 8 matrix, 5 Newton–Schulz steps, each X·Xᵀ, A·A and B·X: 2·8³ FLOPs apiece."""
WORKSPACE = 4 * 64 + 3 * 64
"""Newton–Schulz's workspace for an 8 x 8 matrix, in elements (4·r·c + 3·min(r, c)², docs/cli.md)."""


@pytest.fixture
def tiny(write_module: Callable[[str], str], tmp_path: Path) -> list[str]:
    return ["--model", f"{write_module(MODEL)}:build", "--config", write_file(tmp_path, "muon.toml", MUON), "--no-trace"]


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> list[dict[str, Any]]:
    status, out, err = run(capsys, "dump-param-groups", *argv, "--format", "json")
    assert status == 0 and err == "", err
    plans: list[dict[str, Any]] = json.loads(out)["owner_compute"]
    return plans


def test_hsdp_2x2_gives_one_matrix_per_rank_with_bytes_written_by_hand(capsys: pytest.CaptureFixture[str], tiny: list[str]) -> None:
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "2x2")
    assert plan["mesh"] == {"replicate": 2, "shard": 2} and plan["world_size"] == 4 and plan["orthogonalize"] == "owner"
    (bucket,) = plan["buckets"]
    assert [(u["param"], u["owners"]) for u in bucket["units"]] == [(name, [rank]) for rank, name in enumerate(NAMES)]
    # Rank (r, s) holds rows 4s:4s+4 of every matrix (32 floats, 128 bytes). An owner gets the
    # half it lacks from the same-replica rank (in-node), 128 bytes, and sends each of the three
    # others its half of the result: 384 bytes. Every rank: sends 128 + 384, receives 128 + 3 x 128.
    for rank in bucket["ranks"]:
        whole = (2 * 64 + WORKSPACE) * 4  # the matrix, its workspace, the result: on its owner
        kept = 4 * 32 * 4  # its half of each of the 4 results
        assert rank == {"rank": rank["rank"], "sent": 512, "received": 512, "transient": 1024 + whole + kept, "flops": NS_FLOPS}
    assert [r["vs_one_process"] for r in plan["ranks"]] == [0.25] * 4
    assert plan["one_process_flops"] == 4 * NS_FLOPS and plan["busiest_vs_one_process"] == 0.25

    status, out, err = run(capsys, "dump-param-groups", *tiny, "--mesh", "2x2")
    assert status == 0 and err == ""
    text = out[out.index("owner-computes plan"):]
    assert " ".join(text.split()).startswith(
        "owner-computes plan of muon on replicate=2 x shard=2 (4 ranks): tp_mode auto, bucket_size 1 GiB, fsdp_orthogonalize "
        "auto -> owner; 4 float32 matrices in 1 bucket bucket 0:"
    )
    owners = [re.split(r"\s{2,}", line.strip()) for line in text.splitlines() if line.startswith("layers.")]
    assert owners == [[name, "8x8", "-", "whole", str(rank)] for rank, name in enumerate(NAMES)]  # no TP dim: no style
    totals = text[text.index("per rank, all buckets"):].splitlines()
    assert [re.split(r"\s{2,}", line.strip()) for line in totals[3:8]] == [
        *([str(r), "512 B", "512 B", "3.75 KiB", "15.36 kFLOP", "0.250"] for r in range(4)),
        ["all", "2 KiB", "2 KiB", "61.44 kFLOP", "1.000"],
    ]
    assert "busiest rank 0: 15.36 kFLOP of Newton-Schulz, 0.250 of one process's 61.44 kFLOP" in " ".join(text.split())


def test_fsdp_by_tp_layer_sharded_and_duplicated(capsys: pytest.CaptureFixture[str], tiny: list[str]) -> None:
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "dp=2,tp=2")
    assert plan["mesh"] == {"shard": 2, "tp": 2} and plan["tp_mode"] == "auto"
    assert plan["tp_styles"] == dict(zip(NAMES, ["colwise", "rowwise"] * 2))
    (bucket,) = plan["buckets"]
    assert [u["owners"] for u in bucket["units"]] == [[0], [1], [2], [3]]
    # No replicas: each of the 4 ranks holds a quarter (16 floats) of every matrix. An owner
    # receives 3 quarters and sends 3 back; the others send and receive one quarter each.
    for rank in bucket["ranks"]:
        assert (rank["sent"], rank["received"], rank["flops"]) == (192 + 3 * 64, 192 + 3 * 64, NS_FLOPS)
        assert rank["transient"] == 768 + (2 * 64 + WORKSPACE) * 4 + 4 * 16 * 4

    # duplicated: one owner per TP rank class (tp coordinate 0: ranks 0 and 2; 1: ranks 1 and 3)
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "2", "--tp", "2", "--tp-mode", "duplicated")
    assert [u["owners"] for u in plan["buckets"][0]["units"]] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert {u["how"] for u in plan["buckets"][0]["units"]} == {"duplicated"}
    assert [r["vs_one_process"] for r in plan["ranks"]] == [0.5] * 4

    # distributed: each matrix on one TP group (ranks 0, 1 or ranks 2, 3), each rank its own TP block,
    # the groups taking turns; each rank's share of a matrix's FLOPs is half
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "dp=2,tp=2", "--tp-mode", "distributed")
    assert [u["owners"] for u in plan["buckets"][0]["units"]] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert {u["how"] for u in plan["buckets"][0]["units"]} == {"distributed"}
    # per rank and step of the sharded loop: X_r·X_rᵀ and B·X_r on its 4 of 8 columns (2·8²·4 each),
    # and the 8 x 8 square A·A that every rank repeats (2·8³); two matrices per TP group
    assert [r["flops"] for r in plan["ranks"]] == [2 * 5 * (2 * 2 * 8 * 8 * 4 + 2 * 8**3)] * 4

    # blockwise: each TP block alone, colwise by rows, rowwise by columns
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "dp=2,tp=2", "--tp-mode", "blockwise")
    units = [u for b in plan["buckets"] for u in b["units"]]
    assert {u["how"] for u in units} == {"blockwise"}
    assert sorted((u["label"], u["rows"], u["cols"]) for u in units) == sorted(
        (f"{name} {cut}", *shape)
        for name, (first, second, shape) in zip(NAMES, [("rows 0:4", "rows 4:8", (4, 8)), ("cols 0:4", "cols 4:8", (8, 4))] * 2)
        for cut in (first, second)
    )


def test_small_bucket_size_splits_the_plan_and_keeps_each_bucket_under_it(capsys: pytest.CaptureFixture[str], tiny: list[str]) -> None:
    # One matrix on its owner alone holds (2·64 + 448)·4 = 2304 bytes: a 3 KiB cap fits one per bucket.
    (plan,) = _plan_json(capsys, *tiny, "--mesh", "2x2", "--bucket-size", "3KiB")
    assert plan["bucket_size"] == 3072
    assert [len(b["units"]) for b in plan["buckets"]] == [1, 1, 1, 1]
    assert all(r["transient"] <= 3072 for b in plan["buckets"] for r in b["ranks"])
    assert [b["units"][0]["owners"] for b in plan["buckets"]] == [[0], [1], [2], [3]]  # the load carried across buckets


def test_tp_mode_and_bucket_size_default_to_the_config_and_flags_win(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "dup.toml", MUON + "    muon_tp_mode = \"duplicated\"\n    muon_bucket_size = 3072\n")
    model = ["--model", f"{write_module(MODEL)}:build", "--config", config, "--no-trace"]
    (plan,) = _plan_json(capsys, *model, "--mesh", "dp=2,tp=2")
    # one 8 x 8 matrix per owner fits 3 KiB (2304 bytes on it); ranks 0, 1 and 2, 3 own alternate matrices: 2 per bucket
    assert (plan["tp_mode"], plan["bucket_size"], len(plan["buckets"])) == ("duplicated", 3072, 2)
    (plan,) = _plan_json(capsys, *model, "--mesh", "dp=2,tp=2", "--tp-mode", "layer_sharded", "--bucket-size", "1GiB")
    assert (plan["tp_mode"], plan["bucket_size"], len(plan["buckets"])) == ("layer_sharded", 1 << 30, 1)


def test_tp_params_left_alone_are_planned_on_the_data_parallel_dims(
    capsys: pytest.CaptureFixture[str], tiny: list[str], tmp_path: Path
) -> None:
    plans = _plan_json(capsys, *tiny, "--mesh", "2x2", "--tp", "2", "--tp-plan", "layers.0.*=colwise")
    assert [(p["mesh"], sorted(p["tp_styles"])) for p in plans] == [
        ({"replicate": 2, "shard": 2, "tp": 2}, NAMES[:2]),
        ({"replicate": 2, "shard": 2}, NAMES[2:]),  # fully_shard puts them on the (replicate, shard) mesh
    ]
    status, out, err = run(capsys, "dump-param-groups", *tiny, "--mesh", "2", "--tp", "2", "--tp-plan", "linear_fc1=colwise,w9=rowwise")
    assert status == 0
    assert err == "optzoo: warning: `--tp-plan`: rules match no Muon-family param: w9=rowwise\n"


LLAMA = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "gate_proj": "colwise", "up_proj": "colwise",
         "o_proj": "rowwise", "down_proj": "rowwise"}  # fmt: skip
"""Llama's TP plan (transformers' ``LlamaConfig.base_model_tp_plan``; torchtitan's Llama the same under its names)."""


def test_the_default_tp_plan_covers_hugging_face_llama_names(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    # A Llama whose config carries no TP plan: the default's names decide.
    module = write_module("""
        import transformers

        def build():
            config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                                              num_attention_heads=2, num_key_value_heads=2, vocab_size=32)
            config.base_model_tp_plan = None
            return transformers.AutoModelForCausalLM.from_config(config)
    """)
    (plan, *_) = _plan_json(capsys, "--model", f"{module}:build", "--config", "muon-llm", "--mesh", "dp=2,tp=2")
    assert plan["tp_plan"] == "the default"
    styles = plan["tp_styles"]
    assert styles and {name: LLAMA[name.split(".")[-2]] for name in styles} == styles


def test_a_hugging_face_model_brings_its_own_tp_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # transformers' PhiConfig.base_model_tp_plan: q/k/v_proj and mlp.fc1 colwise, self_attn.dense and
    # mlp.fc2 rowwise; the default plan knows neither dense nor fc1/fc2.
    (plan, *_) = _plan_json(capsys, "--model", "hf:PhiConfig", "--config", "muon-llm", "--mesh", "dp=2,tp=2")
    phi = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "dense": "rowwise", "fc1": "colwise", "fc2": "rowwise"}
    assert plan["tp_plan"] == "the model's base_model_tp_plan"
    styles = plan["tp_styles"]
    assert len(styles) == 12 and {name: phi[name.split(".")[-2]] for name in styles} == styles
    (plan, *_) = _plan_json(capsys, "--model", "hf:PhiConfig", "--config", "muon-llm", "--mesh", "dp=2,tp=2", "--tp-plan", "fc1=rowwise")
    assert plan["tp_plan"] == "--tp-plan"  # the flag wins; the rest is left alone by TP (planned on dp)
    assert set(plan["tp_styles"].values()) == {"rowwise"} and all(".mlp.fc1." in name for name in plan["tp_styles"])


PLACEMENTS_SCRIPT = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from optzoo.mesh_plan import mesh_placements, param_mesh, parse_mesh

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
checked = 0
for spec, names, dp in [("4", ("shard",), ("shard",)), ("2x2", ("replicate", "shard"), ("replicate", "shard")),
                        ("dp=2,tp=2", ("shard", "tp"), ("shard",)), ("replicate=2,shard=2,tp=2", ("replicate", "shard", "tp"),
                        ("replicate", "shard"))]:
    mesh = parse_mesh(spec)
    device_mesh = init_device_mesh("cpu", mesh.shape, mesh_dim_names=names)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Linear(8, 8))
    styles = {"0": "colwise", "1": "rowwise", "2": "replicate"}
    if "tp" in names:
        parallelize_module(model, device_mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    fully_shard(model, mesh=device_mesh[dp] if len(dp) > 1 else device_mesh[dp[0]])
    for name, param in model.named_parameters():
        style = styles[name.split(".")[0]] if "tp" in names else "replicate"
        assert tuple(param.placements) == mesh_placements(param.shape, style, mesh), (spec, name, param.placements)
        assert tuple(param.device_mesh.shape) == param_mesh(style, mesh).shape, (spec, name)
        checked += 1
print(checked)
"""


def test_placements_are_those_fully_shard_and_parallelize_module_give() -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(PLACEMENTS_SCRIPT)], capture_output=True, text=True,
                            cwd=REPO_ROOT, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["24"]  # 4 meshes x 3 layers x (weight, bias)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "2"], r"`--tp`: needs --mesh; got --tp without it; expected --mesh SPEC as well \(e\.g\. --mesh 2x2\)"),
        (["--bucket-size", "1MiB"], r"`--bucket-size`: needs --mesh"),
        (["--mesh", "2y2"], r"`--mesh`: not a mesh dim; got '2y2' in '2y2'; expected N, RxS, or named sizes such as dp=2,tp=2"),
        (["--mesh", "dpp=2"], r"`--mesh`: not a mesh dim; got 'dpp=2' .*; did you mean 'dp'\?"),
        (["--mesh", "tp=2"], r"`--mesh`: needs FSDP's shard dim .*; got 'tp=2'"),
        (["--mesh", "dp=2,fsdp=2"], r"`--mesh`: dim 'shard' given twice; got 'dp=2,fsdp=2'; expected each dim once"),
        (["--mesh", "0"], r"`--mesh`: dim 'shard' must have at least 1 rank; got 0; expected an integer >= 1"),
        (["--mesh", "2", "--tp", "0"], r"`--tp`: dim 'tp' must have at least 1 rank; got 0"),
        (["--mesh", "dp=2,tp=2", "--tp", "2"], r"`--tp`: the mesh already has a tp dim; got --tp 2 with --mesh 'dp=2,tp=2'"),
        (["--mesh", "4096x2"], r"`--mesh`: too many ranks; got replicate=4096 x shard=2 \(8192 ranks\); expected at most 4096"),
        (["--mesh", "2x2", "--tp-plan", "wq=colwise"],
         r"`--tp-plan`: needs a tensor-parallel mesh dim; got --tp-plan with --mesh '2x2'; expected --tp T, or tp=T in --mesh"),
        (["--mesh", "2", "--tp", "2", "--tp-plan", "wq=colwse"],
         r"`--tp-plan`: not a rule; got 'wq=colwse'; expected GLOB=STYLE with STYLE one of \['colwise', 'rowwise', "
         r"'replicate'\]; did you mean 'colwise'\?"),
        (["--mesh", "dp=2,tp=2", "--tp-plan", "wq"], r"`--tp-plan`: not a rule; got 'wq'"),
        (["--mesh", "2", "--bucket-size", "12XB"], r"`--bucket-size`: not a positive byte count; got '12XB'; expected an integer"),
        (["--mesh", "2", "--bucket-size", "0"], r"`--bucket-size`: not a positive byte count; got '0'"),
    ],
)
def test_bad_mesh_flags_name_the_flag_and_the_allowed_values(
    capsys: pytest.CaptureFixture[str], tiny: list[str], argv: list[str], message: str
) -> None:
    line = run_error(capsys, "dump-param-groups", *tiny, *argv)
    assert re.fullmatch(f"optzoo: error: {message}.*", line), line


def test_an_unknown_tp_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str], tiny: list[str]) -> None:
    line = run_usage_error(capsys, "dump-param-groups", *tiny, "--mesh", "2", "--tp-mode", "sideways")
    assert "argument --tp-mode: invalid choice: 'sideways'" in line and "'layer_sharded'" in line


def test_no_muon_params_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "dump-param-groups", "--model", "gpt", "--mesh", "2")
    assert status == 0
    assert out.rstrip().endswith("owner-computes plan on shard=2 (2 ranks): no Muon-family params to plan")


def test_params_stepped_through_a_view_are_listed_as_gathered(capsys: pytest.CaptureFixture[str]) -> None:
    # GPT-2's Conv1D weights are stored [in, out] (transformers' pytorch_utils.Conv1D): the forward
    # multiplies by their transpose, so Muon steps them through a view, on its plain path.
    status, out, err = run(capsys, "dump-param-groups", "--model", "hf:GPT2Config", "--config", "muon-llm", "--mesh", "2",
                           "--format", "json")  # fmt: skip
    assert status == 0
    document = json.loads(out)
    assert document["owner_compute"] == []
    assert document["owner_compute_gathered"] == [
        f"transformer.h.{i}.{name}.weight" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
