"""Golden files: the exact output of ``optzoo dump-param-groups --model gpt --explain``.

The files in ``tests/cli/golden/`` freeze what the command prints for the built-in GPT with the
default config (lr=1e-3, standard overrides): the group table, a blank line, then one row per
parameter with the rules that matched it. ``dump_param_groups_gpt_explain.txt`` is an
80-column terminal (or a pipe), where roles and rules go on lines under their row;
``..._wide.txt`` a terminal wide enough for one line per parameter. Any change to routing, group
order, rule descriptions or table layout shows up here as a diff.

To regenerate it after an intended change, run::

    OPTZOO_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/cli/test_golden.py

then review the diff (``git diff tests/cli/golden``) and commit it with the change. With
``OPTZOO_UPDATE_GOLDEN=1`` the test rewrites the file and passes.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from optzoo.cli import main

GOLDEN_DIR = Path(__file__).parent / "golden"
ARGV = ["dump-param-groups", "--model", "gpt", "--explain"]


@pytest.mark.parametrize(("columns", "name"), [(80, "dump_param_groups_gpt_explain.txt"), (300, "dump_param_groups_gpt_explain_wide.txt")])
def test_dump_param_groups_gpt_explain_matches_golden_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, columns: int, name: str
) -> None:
    GOLDEN = GOLDEN_DIR / name
    monkeypatch.setenv("COLUMNS", str(columns))
    status = main(ARGV)
    out, err = capsys.readouterr()
    assert status == 0
    assert err == ""
    if os.environ.get("OPTZOO_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(out)
    expected = GOLDEN.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(keepends=True), out.splitlines(keepends=True),
                                        fromfile=str(GOLDEN), tofile="optzoo " + " ".join(ARGV)))  # fmt: skip
    assert out == expected, (
        "output differs from the golden file; if the change is intended, regenerate it with "
        f"OPTZOO_UPDATE_GOLDEN=1 (see this module's docstring):\n{diff}"
    )
