"""The wheel installs one import package, ``optzoo``, and the README's example runs from it.

The repository keeps ``routing/`` and ``optimizers/`` at its top level; the build must install
them as ``optzoo.routing`` and ``optzoo.optimizers`` (generic top-level names would collide with
unrelated distributions on the package index). The test builds the wheel from a copy of the
sources without the checkout's ``optzoo/routing`` and ``optzoo/optimizers`` links (so the build
does not lean on them), installs it into a fresh virtual environment whose dependencies (torch,
...) come from this one through a ``.pth`` line, and runs the README's example there, away from
the checkout.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "optzoo", "routing", "optimizers")


def _run(*argv: str | Path, cwd: Path, stderr: bool = False) -> str:
    """stdout of ``argv`` (with ``stderr=True``, stdout then stderr); it must succeed."""
    done = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr if stderr else done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the wheel, the fresh venv's python, its site-packages)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=lambda folder, names: [
                n for n in names if n == "__pycache__" or (Path(folder) / n).is_symlink()
            ])  # fmt: skip
        else:
            shutil.copy2(path, source / name)
    assert not (source / "optzoo" / "routing").exists()
    # Verbose, so the build backend's own output (setuptools' warnings) is kept in build.log.
    log = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "--wheel-dir", work / "dist", source, cwd=work, stderr=True)
    (work / "build.log").write_text(log)
    (wheel,) = (work / "dist").glob("optzoo-*.whl")
    _run(sys.executable, "-m", "venv", "--without-pip", work / "venv", cwd=work)
    python = work / "venv" / "bin" / "python"
    site_packages = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=work).strip())
    _run(sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", site_packages, wheel, cwd=work)
    # The dependencies of this environment; its .pth files (the editable optzoo) are not read from there.
    (site_packages / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return wheel, python, site_packages


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_package(installed: tuple[Path, Path, Path]) -> None:
    wheel, _, site_packages = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert {name.split("/")[0] for name in names} == {"optzoo", *{n.split("/")[0] for n in names if ".dist-info/" in n}}
    modules = {
        f"{prefix}/{path.relative_to(folder).as_posix()}"
        for prefix, folder in (("optzoo", ROOT / "optzoo"), ("optzoo/routing", ROOT / "routing"), ("optzoo/optimizers", ROOT / "optimizers"))
        for path in folder.rglob("*.py")
        if not (prefix == "optzoo" and path.relative_to(folder).parts[0] in ("routing", "optimizers"))
    }
    assert sorted(modules - set(names)) == []  # every module of the checkout, subpackages included
    assert {"optzoo/py.typed", "optzoo/recipes/muon-llm.toml"} <= set(names)
    top_level = sorted(p.name for p in site_packages.iterdir() if p.name != "bin")
    assert [n for n in top_level if not n.endswith(".dist-info")] == ["dependencies.pth", "optzoo"]
    assert not (site_packages / "routing").exists() and not (site_packages / "optimizers").exists()


@pytest.mark.slow
def test_the_build_prints_no_setuptools_warning(installed: tuple[Path, Path, Path]) -> None:
    """Issue 25: the build printed a wall about `optzoo.recipes`, a folder Python can import but
    `packages` did not list."""
    wheel, _, _ = installed
    log = (wheel.parent.parent / "build.log").read_text()
    assert "Building wheel for optzoo" in log  # the backend's output is in the log
    warnings = [line for line in log.splitlines() if re.search(r"Warning\b|would be ignored", line)]
    assert warnings == []


@pytest.mark.slow
def test_the_readme_example_runs_from_the_installed_wheel(installed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, python, site_packages = installed
    (example,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    check = example + (
        "\nimport importlib.util, optzoo, optzoo.routing, optzoo.optimizers.muon\n"
        "assert importlib.util.find_spec('routing') is None and importlib.util.find_spec('optimizers') is None\n"
        "print(optzoo.__file__, optzoo.routing.__file__, optzoo.optimizers.muon.__file__, sep='\\n')\n"
    )
    out = _run(python, "-c", check, cwd=tmp_path)
    for line in out.splitlines()[-3:]:
        assert line.startswith(str(site_packages / "optzoo")), line


@pytest.mark.slow
def test_the_installed_command_line_runs(installed: tuple[Path, Path, Path], tmp_path: Path) -> None:
    _, python, _ = installed
    script = (
        "import os\n"
        "os.environ['COLUMNS'] = '200'  # one line per table row\n"
        "from importlib.metadata import entry_points\n"
        "(main,) = entry_points(group='console_scripts', name='optzoo')\n"
        "raise SystemExit(main.load()(['dump-param-groups', '--model', 'gpt', '--config', 'muon-llm']))\n"
    )
    out = _run(python, "-c", script, cwd=tmp_path)
    assert out.splitlines()[0].split() == ["group", "optimizer", "lr", "weight_decay", "other", "overrides", "params", "elements"]
    assert " muon " in out
