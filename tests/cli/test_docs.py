"""The docs cannot rot: their examples run, and their tables match the code.

- Every ```python block of ``docs/*.md`` runs; the blocks of one file run in order in one
  namespace, in a temporary working directory.
- A block whose first line is ``# file: NAME`` is also written to ``NAME`` in that directory,
  so the ```console examples can use it as a config file.
- Every ```console block is a list of ``$ optzoo ...`` commands, each followed by its exact
  output (stdout and stderr together); each is run through ``optzoo.cli.main``.
- Every ```toml block loads with ``load_config_file`` and routes the built-in GPT.
- The field table of ``docs/megatron.md`` lists every ``OptimizerConfig`` field with its default,
  whether it is per group, and "ValueError" for every unsupported one.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from optzoo.cli import main
from optzoo.config import _UNSUPPORTED, GROUP_FIELDS, OptimizerConfig
from optzoo.config_file import load_config_file

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["index.md", "getting-started.md", "routing.md", "roles.md", "routing-real-models.md", "cli.md", "optimizers.md", "megatron.md", "mixed-precision.md", "distributed.md", "limitations.md", "schedules.md", "integrations.md", "telemetry.md"]


@dataclass(frozen=True)
class Block:
    lang: str
    line: int
    """1-based line of the first line of code (after the opening fence)."""
    text: str

    @property
    def file_name(self) -> str | None:
        first = self.text.splitlines()[0] if self.text else ""
        match = re.fullmatch(r"#\s*file:\s*(\S+)\s*", first)
        return match.group(1) if match else None


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    found, lang, start, body = [], None, 0, []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        fence = re.fullmatch(r"\s*```\s*([\w+-]*)\s*", line)
        if lang is None and fence:
            lang, start, body = fence.group(1), number + 1, []
        elif lang is not None and fence and not fence.group(1):
            found.append(Block(lang, start, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{page}: unclosed code fence opened at line {start - 1}"
    return found


def all_blocks(lang: str) -> list[tuple[str, Block]]:
    return [(page.name, b) for page in sorted(DOCS.glob("*.md")) for b in blocks(page) if b.lang == lang]


def write_named_files(page: Path, directory: Path) -> None:
    for block in blocks(page):
        if block.file_name:
            (directory / block.file_name).write_text(block.text)


def test_every_page_exists() -> None:
    for name in PAGES:
        assert (DOCS / name).is_file(), name


def test_relative_links_point_at_existing_files() -> None:
    for page in sorted(DOCS.glob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


@pytest.mark.parametrize("name", PAGES)
def test_python_blocks_run(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = DOCS / name
    monkeypatch.chdir(tmp_path)
    write_named_files(page, tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    for block in blocks(page):
        if block.lang == "python":
            code = compile(block.text, f"{page}:{block.line}", "exec")
            exec(code, namespace)  # noqa: S102 - running the docs' own examples is the point


def test_readme_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = DOCS.parent / "README.md"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "docs.readme"}
    python_blocks = [b for b in blocks(readme) if b.lang == "python"]
    assert python_blocks
    for block in python_blocks:
        exec(compile(block.text, f"{readme}:{block.line}", "exec"), namespace)  # noqa: S102


def test_docs_have_python_examples() -> None:
    assert len(all_blocks("python")) >= 15


def console_commands(block: Block) -> list[tuple[str, str]]:
    """``[(command line, expected output)]`` of one ```console block."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        else:
            assert commands, f"console block at line {block.line}: output before the first `$ ` command"
            commands[-1][1].append(line)
    return [(command, "\n".join(output)) for command, output in commands]


CONSOLE = [
    pytest.param(page, block, command, expected, id=f"{page}:{block.line}:{command}")
    for page, block in all_blocks("console")
    for command, expected in console_commands(block)
]


@pytest.mark.parametrize(("page", "block", "command", "expected"), CONSOLE)
def test_console_examples_print_what_the_docs_show(
    page: str, block: Block, command: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    program, *argv = shlex.split(command)
    assert program == "optzoo"
    write_named_files(DOCS / page, tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OPTZOO_NS_VARIANT")  # the suite's pin (tests/conftest.py): the docs show a user's default output
    try:
        status = main(argv)
    except SystemExit as exited:
        status = exited.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert (out + err).rstrip("\n") == expected.rstrip("\n")
    assert status == (2 if "optzoo: error:" in expected else 0)


def test_docs_have_console_examples() -> None:
    assert len(CONSOLE) >= 4


@pytest.mark.parametrize(("page", "block"), [pytest.param(p, b, id=f"{p}:{b.line}") for p, b in all_blocks("toml")])
def test_toml_blocks_are_valid_config_files(
    page: str, block: Block, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "example.toml"
    path.write_text(block.text)
    config, overrides = load_config_file(path)
    assert isinstance(config, OptimizerConfig)
    assert main(["dump-param-groups", "--model", "gpt", "--config", str(path), "--strict"]) == 0
    assert capsys.readouterr().err == ""


# ---- docs/megatron.md's field table ----------------------------------------------------------


def megatron_rows() -> dict[str, list[str]]:
    """``{field: [default, per group, description]}`` from the table of docs/megatron.md."""
    rows: dict[str, list[str]] = {}
    for line in (DOCS / "megatron.md").read_text().splitlines():
        match = re.match(r"\| `(\w+)` \|(.*)\|\s*$", line)
        if match and match.group(1) in {f.name for f in dataclasses.fields(OptimizerConfig)} | {"field"}:
            cells = [cell.strip() for cell in match.group(2).split(" | ")]
            assert len(cells) == 3, line
            assert match.group(1) not in rows, f"{match.group(1)} listed twice"
            rows[match.group(1)] = cells
    return rows


def test_megatron_table_lists_every_field_in_order_with_its_default() -> None:
    rows = megatron_rows()
    fields = dataclasses.fields(OptimizerConfig)
    assert list(rows) == [f.name for f in fields]
    for field in fields:
        default = rows[field.name][0]
        assert re.fullmatch(r"`[^`]+`", default), (field.name, default)
        assert eval(default.strip("`"), {"torch": torch}) == field.default, field.name  # noqa: S307


def test_megatron_table_per_group_column_is_group_fields() -> None:
    rows = megatron_rows()
    assert {name for name, cells in rows.items() if cells[1] == "yes"} == set(GROUP_FIELDS)
    assert {cells[1] for cells in rows.values()} == {"yes", "no"}


def test_megatron_table_marks_every_unsupported_field_with_its_reason() -> None:
    rows = megatron_rows()
    for field, inert, why in _UNSUPPORTED:
        description = rows[field][2]
        assert "**ValueError**" in description, field
        assert why in description, (field, why)
        assert f"`{inert!r}`" in description, (field, inert)
    marked = {name for name, cells in rows.items() if "**ValueError**" in cells[2]}
    assert marked == {field for field, _, _ in _UNSUPPORTED}
