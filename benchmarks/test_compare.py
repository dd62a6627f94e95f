"""``python -m benchmarks.compare --quick``: one row per registered algorithm, refusals as rows.

These tests check structure, exact byte counts and the docs block, never timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import compare, report
from optzoo.optimizers import registry

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NAMES = ("adam", "sgd", "muon")


def _run(*argv: str) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = compare.main([*argv, "--no-progress"])
    return status, stdout.getvalue()


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, Path, dict[str, Any]]:
    """One quick run of three names through the entry point: (status, stdout, out folder, results)."""
    out = tmp_path_factory.mktemp("compare")
    status, stdout = _run("--quick", "--device", "cpu", "--only", ",".join(NAMES), "--out", str(out))
    return status, stdout, out, json.loads((out / "results.json").read_text())


def _table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table's headers and rows, cells stripped."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    end = next((i for i, row in enumerate(cells[2:], 2) if row[0] == "algorithm"), len(cells))  # the sweep table's header
    return cells[0], cells[2:end]


@pytest.mark.slow
def test_quick_run_has_a_row_per_requested_name_and_every_column(quick: tuple[int, str, Path, dict[str, Any]]) -> None:
    status, stdout, out, _ = quick
    assert status == 0
    headers, rows = _table((out / "table.md").read_text())
    assert [row[0] for row in rows] == list(NAMES)
    assert headers == [
        "algorithm", "family",
        "step ×AdamW(fused) (cpu)", "step ×AdamW(fused) (cuda)",
        "first step s (cpu): optzoo / upstream", "first step s (cuda): optzoo / upstream",
        "state B/param: measured / record", "fallback (params, % of weights)",
        "GPT (built-in task): held-out loss @ lr", "Llama (HF, tiny): held-out loss @ lr",
    ]  # fmt: skip
    for row in rows:
        assert len(row) == len(headers)
        assert float(row[2]) > 0 and row[3] == "n/a" and row[5] == "n/a"  # no GPU columns measured on a CPU run
        for loss in row[8:]:
            value, lr = loss.split(" @ ")
            assert 0 < float(value) < 10 and float(lr) > 0
    assert "python -m benchmarks.compare --quick --device cpu --only adam,sgd,muon" in stdout
    assert (out / "compare.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.slow
def test_state_bytes_match_hand_counts(quick: tuple[int, str, Path, dict[str, Any]]) -> None:
    """torch's AdamW keeps two fp32 moments and a 4-byte ``step`` per param tensor; SGD one momentum buffer."""
    *_, results = quick
    model = compare._with_grads(compare.QUICK.timing_model, torch.device("cpu"))
    numel, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    rows = {row["name"]: row for row in results["rows"]}
    assert rows["adam"]["state_measured"] == rows["adam"]["state_record"] == (8 * numel + 4 * tensors) / numel
    assert rows["sgd"]["state_measured"] == rows["sgd"]["state_record"] == 4.0
    assert rows["muon"]["state_measured"] == rows["muon"]["state_record"]
    assert rows["muon"]["fallback"].startswith("adam: ")  # embeddings, output layer and 1-D params
    assert rows["adam"]["fallback"] == "-"


@pytest.mark.slow
def test_same_init_and_batches_for_every_algorithm(quick: tuple[int, str, Path, dict[str, Any]]) -> None:
    """Every run starts from one init on one batch, so every first training loss is the same number."""
    *_, results = quick
    for label in ("GPT (built-in task)", "Llama (HF, tiny)"):
        firsts = {run["curve"][0] for row in results["rows"] for run in row["tasks"][label]["runs"]}
        assert len(firsts) == 1, (label, firsts)
        assert abs(firsts.pop() - math.log(256)) < 0.3  # a random init's loss over 256 bytes


@pytest.fixture
def extra_names() -> Iterator[None]:
    """Two names registered after the command was written: one that works, one whose build refuses."""

    def refuse(groups: Any, instance: Any) -> torch.optim.Optimizer:
        raise ValueError("needs Sinkhorn-normalised non-negative params\nsecond line")

    sgd = registry.get_spec("sgd")
    registry.register(dataclasses.replace(sgd, name="zz_later", family="unheard_of"))  # type: ignore[arg-type]
    registry.register(dataclasses.replace(sgd, name="zz_refuses", build=refuse))
    try:
        yield
    finally:
        registry.unregister("zz_later")
        registry.unregister("zz_refuses")


@pytest.mark.slow
@pytest.mark.usefixtures("extra_names")
def test_every_registered_name_gets_a_row_and_a_refusal_is_a_row(tmp_path: Path) -> None:
    status, _ = _run("--quick", "--device", "cpu", "--only", "sgd,zz_refuses,zz_later", "--out", str(tmp_path))
    assert status == 0
    _, rows = _table((tmp_path / "table.md").read_text())
    by_name = {row[0]: row for row in rows}
    assert list(by_name) == ["sgd", "zz_refuses", "zz_later"]
    assert by_name["zz_refuses"][2] == "**refused: ValueError: needs Sinkhorn-normalised non-negative params**"
    assert by_name["zz_later"][1] == "unheard_of" and by_name["zz_later"][8].endswith(f"@ {report.lr_text(compare.DEFAULT_LR_GRID[1])}")
    # Without --only the names are the registry's, whatever it holds now.
    assert compare._names(None) == registry.registered_names() and "zz_later" in compare._names(None)


@pytest.mark.slow
def test_docs_block_is_replaced_between_markers(tmp_path: Path) -> None:
    docs = tmp_path / "page.md"
    docs.write_text(f"# Title\n\nbefore\n\n{report.BEGIN}\nold table\n{report.END}\n\nafter\n")
    for _ in range(2):  # a rerun replaces the block, keeping what is around it
        status, _ = _run("--quick", "--device", "cpu", "--only", "sgd", "--out", str(tmp_path / "out"), "--docs", str(docs))
        assert status == 0
    text = docs.read_text()
    assert text.startswith(f"# Title\n\nbefore\n\n{report.BEGIN}\n") and text.endswith(f"\n{report.END}\n\nafter\n")
    assert "old table" not in text
    assert sum(line.startswith("| sgd ") for line in text.splitlines()) == 3  # main table, sweep on each task
    assert f"Command: `python -m benchmarks.compare --quick --device cpu --only sgd --out {tmp_path / 'out'} --docs {docs} --no-progress`" in text
    assert "![Training loss per algorithm at its best lr, and step time](img/compare.png)" in text
    assert (tmp_path / "img" / "compare.png").read_bytes().startswith(PNG_MAGIC)


def test_docs_without_markers_is_refused_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "page.md"
    docs.write_text("# no markers\n")
    assert compare.main(["--quick", "--only", "sgd", "--docs", str(docs), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"benchmarks.compare: error: `{docs}`: no single marked block; got 0 begin and 0 end markers; "
        f"expected one {report.BEGIN!r} line before one {report.END!r} line\n"
    )
    assert docs.read_text() == "# no markers\n" and not (tmp_path / "out").exists()


def test_unknown_only_name_lists_the_registered_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--quick", "--only", "adam,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("benchmarks.compare: error: `--only`: unknown optimizer names; got ['nope']; expected a comma-separated subset of ['adam', ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--device", "cuda", "--quick"]) == 2
    assert capsys.readouterr().err == "benchmarks.compare: error: `--device`: unavailable; got 'cuda'; expected 'cpu' or 'auto' (no GPU here)\n"
