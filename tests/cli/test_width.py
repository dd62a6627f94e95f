"""Every text output of ``optzoo`` fits an 80-column terminal (issue 25).

Three ways in, from the cheapest: ``main`` with ``COLUMNS=80`` over every subcommand and
documented flag combination; the ``optzoo`` process on a pseudo-terminal 80 columns wide, with no
``COLUMNS`` (the width read from the terminal, stderr wrapped too); and the same under ``tmux``,
whose ``capture-pane -J`` joins the lines the terminal had to wrap, so a line longer than the
window shows. JSON output is for programs and is never wrapped (docs/cli.md).
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib
import itertools
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
import uuid
from pathlib import Path

import pytest

from optzoo.cli import main
from optzoo.optimizers.registry import get_spec, register, registered_names, unregister

WIDTH = 80

LONG_FINDINGS = """
[config]
lr = 1e-3
[[overrides]]
predicate = "is_2d_matrix"
set = { optimizer = "muon" }
[[overrides]]
name = "*.bias"
set = { wd_mult = 0.0 }
[[overrides]]
predicate = "is_1d"
role = ["bias", "norm"]
set = { wd_mult = 0.0 }
"""
"""Muon on the input table and head, and a shadowed rule: lint findings of 300+ characters."""

OVERRIDES = """
[config]
lr = 1e-3
[[overrides]]
name = "decoder.layers.*.mlp.linear_fc*.weight"
set = { optimizer = "lion", lion_beta1 = 0.9, lion_beta2 = 0.99, weight_decay = 0.2 }
"""
"""A group with other overrides: the group table's widest column."""


def _invocations(tmp_path: Path) -> list[list[str]]:
    findings, overrides = tmp_path / "findings.toml", tmp_path / "overrides.toml"
    findings.write_text(LONG_FINDINGS)
    overrides.write_text(OVERRIDES)
    dump_flags = [[], ["--explain"], ["--lint"], ["--world-size", "2"], ["--world-size", "3", "--distributed-mode", "sharded"]]
    combos = [sum(c, []) for n in range(len(dump_flags) + 1) for c in itertools.combinations(dump_flags[:3], n)]
    combos += [[*c, *w] for c in ([], ["--explain"]) for w in dump_flags[3:]]
    runs: list[list[str]] = [
        ["--help"], ["--version"], ["list"], ["list", "--fields"], ["list", "--help"], ["recipes"], ["recipes", "--help"],
        ["dump-param-groups", "--help"], ["lint", "--help"], ["demo", "--help"],
    ]  # fmt: skip
    for config in (None, str(findings), str(overrides), "muon-llm", "lion-llm"):
        with_config = ["--config", config] if config else []
        runs += [["dump-param-groups", "--model", "gpt", *with_config, *flags] for flags in combos]
        runs.append(["lint", "--model", "gpt", *with_config])
    runs += [
        ["dump-param-groups", "--model", "gpt-qk-norm", "--explain", "--no-trace", "--lint"],
        ["dump-param-groups", "--model", "hf:LlamaConfig", "--config", "muon-llm", "--explain", "--lint", "--world-size", "4",
         "--example-inputs", "input_ids=1x16:int64"],
        ["dump-param-groups", "--model", "hf:MixtralConfig", "--config", "muon-llm", "--explain", "--world-size", "4",
         "--expert-world-size", "2", "--distributed-mode", "sharded"],
        ["dump-param-groups", "--model", "gpt", "--config", "muon-llm", "--mesh", "2x2", "--tp", "2", "--tp-mode", "blockwise",
         "--bucket-size", "1MiB"],
        ["dump-param-groups", "--model", "hf:LlamaConfig", "--config", "muon-llm", "--explain", "--mesh", "dp=2,tp=2",
         "--example-inputs", "input_ids=1x16:int64"],
        ["lint", "--model", "hf:LlamaConfig", "--config", str(findings)],
        ["lint", "--model", "hf:T5Config", "--config", "muon-llm"],
    ]  # fmt: skip
    return runs


def _too_long(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > WIDTH]


@pytest.mark.slow
def test_every_command_and_flag_combination_fits_80_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    runs = _invocations(tmp_path)
    assert len(runs) > 60
    for argv in runs:
        try:
            status = main(argv)
        except SystemExit as exited:  # --help, --version
            status = exited.code  # type: ignore[assignment]
        out, err = capsys.readouterr()
        assert status == 0, (argv, err)
        assert out.strip(), argv
        assert _too_long(out) == [], argv  # stderr is a pipe here: one line per message (the pty test wraps it)


def test_piped_output_without_columns_is_80_wide(capsys: pytest.CaptureFixture[str]) -> None:
    """No ``COLUMNS`` and stdout not a terminal (tests/cli/conftest.py): 80 columns."""
    assert "COLUMNS" not in os.environ
    assert main(["dump-param-groups", "--model", "gpt", "--explain", "--world-size", "2", "--distributed-mode", "sharded"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) == WIDTH  # the owner column reaches the edge, not past it
    assert "    role: matrix (forward: addmm weight)" in out.splitlines()  # roles went under their row


def test_a_wide_terminal_keeps_one_line_per_row(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    assert main(["dump-param-groups", "--model", "gpt", "--explain"]) == 0
    header, rule, *rows = capsys.readouterr().out.split("\n\n")[1].splitlines()
    assert header.split()[:3] == ["parameter", "group", "shape"] and header.rstrip().endswith("matched rules")
    assert len(rows) == 29  # one line per parameter name of the built-in GPT


def _run_on_a_pty(argv: list[str], columns: int) -> str:
    """``python -m optzoo.cli ARGV`` with stdout and stderr on a pseudo-terminal ``columns``
    wide, without ``COLUMNS``; what the terminal received, ``\\r\\n`` made ``\\n``."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    process = subprocess.Popen([sys.executable, "-m", "optzoo.cli", *argv], stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process is done
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif process.poll() is not None:
            break
    process.wait(timeout=60)
    os.close(controller)
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv",
    [
        ["list", "--fields"],
        ["dump-param-groups", "--model", "gpt", "--explain", "--lint", "--world-size", "2", "--distributed-mode", "sharded"],
        ["dump-param-groups", "--model", "gtp"],  # an error: wrapped on a terminal
    ],
    ids=["list", "dump", "error"],
)
def test_a_real_80_column_terminal(argv: list[str]) -> None:
    text = _run_on_a_pty(argv, WIDTH)
    assert len(text.splitlines()) > 2, text
    assert _too_long(text) == []
    if argv[-1] == "gtp":
        assert text.startswith("optzoo: error: `--model`: unknown model; got 'gtp';")
        assert "did you mean 'gpt'?" in " ".join(text.split())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (a system package, not pip's); test_a_real_80_column_terminal checks the same widths on a pty")
def test_tmux_80_columns(tmp_path: Path) -> None:
    """The same in tmux: ``capture-pane -J`` joins what the window wrapped, so an overlong line shows."""
    socket, done = f"optzoo-test-{uuid.uuid4().hex[:8]}", tmp_path / "done"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "TMUX")}
    command = (
        f"{sys.executable} -m optzoo.cli dump-param-groups --model gpt --explain --lint --config muon-llm "
        f"--world-size 2 --distributed-mode sharded; touch {done}; sleep 600"
    )
    tmux = ["tmux", "-L", socket, "-f", "/dev/null"]
    subprocess.run([*tmux, "new-session", "-d", "-x", str(WIDTH), "-y", "50", command], env=env, check=True, timeout=60)
    try:
        subprocess.run([*tmux, "set-option", "-g", "history-limit", "10000"], check=True, timeout=60)
        deadline = time.monotonic() + 300
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert done.exists(), "the command did not finish"
        captured = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-"], check=True, timeout=60, capture_output=True, text=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=60)
    assert "group  optimizer" in captured and "lint finding" in captured
    assert [line for line in captured.splitlines() if len(line.rstrip()) > WIDTH] == []


@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_error() -> None:
    """``optzoo list | head`` (here ``| true``, which leaves before the first line): no
    ``optzoo: error: [Errno 32] Broken pipe`` and status 0, as ``cat`` behaves."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    done = subprocess.run(
        f"{sys.executable} -m optzoo.cli list | true; exit ${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "")


UPSTREAM_PACKAGES = ("orthogonalized_optimizers", "scalar_optimizers", "soap", "psgd", "riemannian_optimizers")
"""emerging-optimizers' packages whose modules register its algorithms on import."""


def _upstream_names() -> list[str]:
    for package in UPSTREAM_PACKAGES:
        importlib.import_module(f"emerging_optimizers.{package}")
    from emerging_optimizers import registry

    return registry.get_optimizer_name_list()


@pytest.fixture
def zoo_of_at_least_19() -> list[str]:
    """The registry with a stand-in record for every emerging-optimizers algorithm not yet
    registered here, and more until it has 19 names (issue 26: the 15 upstream, adam, sgd and
    what optzoo adds), each described at the length of the longest real description."""
    longest = max((get_spec(name) for name in registered_names()), key=lambda spec: len(spec.description))
    missing = [name for name in _upstream_names() if name not in registered_names()]
    missing += [f"optzoo_extra_{i}" for i in range(19 - len(registered_names()) - len(missing))]
    for name in missing:
        register(dataclasses.replace(longest, name=name, description=f"{name}: {longest.description}"))
    try:
        yield registered_names()
    finally:
        for name in missing:
            unregister(name)


@pytest.mark.parametrize("columns", [80, 100])
def test_optzoo_list_of_every_name_fits_the_terminal(
    columns: int, zoo_of_at_least_19: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: `optzoo list` shows every registered name, whole, one row each, and fits 100
    columns (and 80, piped) with 19 names or more."""
    assert len(zoo_of_at_least_19) >= 19
    monkeypatch.setenv("COLUMNS", str(columns))
    for flags in ([], ["--fields"]):
        assert main(["list", *flags]) == 0
        out = capsys.readouterr().out
        assert max(map(len, out.splitlines())) <= columns, (flags, out)
        for name in zoo_of_at_least_19:  # whole, at the start of its row (in a grid or under a plain header)
            assert len(re.findall(rf"^(?:│ )?{re.escape(name)} ", out, re.MULTILINE)) == 1, (name, flags, out)
