"""``optzoo estimate``: its JSON is the API's answer, its table, and its refusals (exit status 2, one line)."""

from __future__ import annotations

import json
import re

import pytest

from optzoo.cli import main


def test_cli_json_is_the_api_answer(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "gpt", "--config", "muon-llm", "--world-size", "2", "--distributed-mode", "sharded", "--format", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["distributed"] == "sharded" and document["world_size"] == 2 and len(document["ranks"]) == 2
    assert set(document["algorithms"]) == {"muon", "adam"}
    for rank in document["ranks"]:
        assert rank["held_bytes"] == rank["state_bytes"] + rank["main_param_bytes"] + rank["grad_buffer_bytes"] + rank["param_sync_bytes"]


def test_cli_table_and_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", "gpt", "--mesh", "2", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s+group\s+optimizer\s+params\s+elements\s+state", out, re.M)
    assert "FSDP2 on shard=2 x tp=2 (4 ranks)" in out.replace("\n    ", " ")
    assert main(["estimate", "--model", "gpt", "--mesh", "2", "--distributed-mode", "sharded"]) == 2
    assert "`--distributed-mode`: plans the layer-wise or ZeRO-1 optimizer, which refuse FSDP2 params" in capsys.readouterr().err
    assert main(["estimate", "--model", "gpt", "--distributed-mode", "sharded"]) == 2
    assert "`--distributed-mode`: needs --world-size" in capsys.readouterr().err


def test_cli_params_dtype_casts_the_model_first(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    """A built-in model is built in float32: under bf16=True its params are their own main params, until
    --params-dtype bfloat16 makes them what training will use (fp32 copies: 4 bytes per element)."""
    import pathlib

    config = pathlib.Path(str(tmp_path)) / "bf16.toml"
    config.write_text('[config]\nlr = 1e-3\nbf16 = true\n')
    main(["estimate", "--model", "gpt", "--config", str(config), "--format", "json"])
    as_built = json.loads(capsys.readouterr().out)
    main(["estimate", "--model", "gpt", "--config", str(config), "--params-dtype", "bfloat16", "--format", "json"])
    cast = json.loads(capsys.readouterr().out)
    elements = sum(group["elements"] for group in cast["groups"])
    assert as_built["ranks"][0]["main_param_bytes"] == 0
    assert cast["ranks"][0]["main_param_bytes"] == cast["ranks"][0]["grad_buffer_bytes"] == 4 * elements
    assert cast["ranks"][0]["model_grad_bytes"] == 2 * elements
