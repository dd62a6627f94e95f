"""The ``optzoo`` command line, called through ``optzoo.cli.main(argv)``.

Each test passes an argv list, then checks the returned exit status and what was printed.
Bad input must give exactly one ``optzoo: error: ...`` line on stderr and status 2, never a
traceback.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch

from optzoo.optimizers.registry import get_spec, registered_names
from optzoo import OptimizerConfig, resolve_group_configs
from optzoo.cli import LINT_EXIT_STATUS, main
from optzoo.distributed import plan_shards
from optzoo.models import GPT, GPTConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---- helpers -------------------------------------------------------------------------------


def columns(line: str) -> list[str]:
    """The cells of a tabulate row (columns are 2+ spaces apart; cells may hold single spaces)."""
    return re.split(r"\s{2,}", line.strip())


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` -> (status, stdout, stderr)."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def run_ok(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert err == ""
    return out


def dump_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """``dump-param-groups ... --format json`` parsed; stderr must be empty."""
    document: dict[str, Any] = json.loads(run_ok(capsys, "dump-param-groups", *argv, "--format", "json"))
    return document


@pytest.fixture
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A terminal wide enough for every table row and message on one line."""
    monkeypatch.setenv("COLUMNS", "1000")


def unwrap(text: str) -> str:
    """``text`` with each wrapped line joined back: continuations start with four spaces."""
    return re.sub(r"\n    ", " ", text)


def assert_one_error_line(err: str) -> str:
    """The whole of stderr is one ``optzoo: error:`` line with no traceback; returns it."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("optzoo: error: "), err
    assert "Traceback" not in err
    return lines[0]


def run_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A bad invocation handled by ``main``: status 2, nothing on stdout, one stderr line."""
    status, out, err = run(capsys, *argv)
    assert status == 2, (out, err)
    assert out == ""
    return assert_one_error_line(err)


def run_usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A bad invocation caught by argparse: SystemExit(2) and one stderr line."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    return assert_one_error_line(err)


def group_of(document: dict[str, Any]) -> dict[str, int]:
    mapping: dict[str, int] = document["param_to_group"]
    return mapping


def builtin_gpt_names() -> list[tuple[str, int]]:
    """(name, ndim) of every parameter of the built-in ``gpt`` model, in model order."""
    with torch.device("meta"):
        model = GPT(GPTConfig())
    return [(name, p.ndim) for name, p in model.named_parameters()]


_module_counter = itertools.count()


@pytest.fixture
def write_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Callable[[str], str]:
    """Write ``source`` as a fresh module under ``tmp_path`` (on sys.path); returns its name.

    Each call gets a new module name, so no test sees another test's cached module.
    """
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"optzoo_cli_test_models_{os.getpid()}_{next(_module_counter)}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        request.addfinalizer(lambda: sys.modules.pop(name, None))
        return name

    return write


def write_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


# ---- list ----------------------------------------------------------------------------------


def test_list_fits_the_width_and_fields_come_on_demand(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15: `optzoo list` was 230 columns wide; issue 25: it fits 80 columns piped, and the
    terminal's width (COLUMNS) when wider, with or without --fields."""
    out = run_ok(capsys, "list")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "config fields (defaults)" not in out and "adam_beta1" not in out
    monkeypatch.setenv("COLUMNS", "100")
    out = run_ok(capsys, "list")
    assert max(len(line) for line in out.splitlines()) <= 100
    assert re.search(r"^\W*lion\s+\W\s+emerging-optimizers\s", out, re.MULTILINE), out
    monkeypatch.setenv("COLUMNS", "120")
    wide = run_ok(capsys, "list", "--fields")
    assert max(len(line) for line in wide.splitlines()) <= 120
    assert "use_precision_aware_optimizer=False" in wide


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_list_table_shows_each_optimizer_with_source_and_fields(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(capsys, "list", "--fields")
    for header in ("name", "source", "shapes", "config fields (defaults)", "description"):
        assert header in out
    rows = {
        "adam": ("torch", ["adam_beta1=0.9", "adam_beta2=0.999", "adam_eps=1e-08", "decoupled_weight_decay=True"]),
        "sgd": ("torch", ["sgd_momentum=0.9"]),
        "lion": ("emerging-optimizers", ["lion_beta1=0.95", "lion_beta2=0.98"]),
    }
    for name, (source, fields) in rows.items():
        assert re.search(rf"^\W*{name}\s+\W\s+{re.escape(source)}\s", out, re.MULTILINE), out
        for field in ("lr=None", "weight_decay=0.01", *fields):
            assert field in out
    # The registry's order: adam, then sgd, then lion.
    assert out.index(" adam ") < out.index(" sgd ") < out.index(" lion ")


def test_list_json_has_every_optimizer_with_field_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    rows = json.loads(run_ok(capsys, "list", "--format", "json"))
    by_name = {row["name"]: row for row in rows}
    assert list(by_name) == registered_names()
    assert list(by_name)[:4] == ["adam", "sgd", "lion", "soap"]
    assert by_name["lion"]["source"] == "emerging-optimizers"
    assert by_name["lion"]["fields"] == {"lr": None, "weight_decay": 0.01, "lion_beta1": 0.95, "lion_beta2": 0.98}
    assert by_name["adam"]["source"] == "torch"
    assert by_name["adam"]["fields"] == {
        "lr": None, "weight_decay": 0.01, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-08,
        "decoupled_weight_decay": True, "use_precision_aware_optimizer": False, "main_params_dtype": "float32",
        "exp_avg_dtype": "float32", "exp_avg_sq_dtype": "float32", "store_param_remainders": True,
    }  # fmt: skip
    assert by_name["sgd"]["fields"] == {"lr": None, "weight_decay": 0.01, "sgd_momentum": 0.9}
    for row in rows:
        assert set(row) == {"name", "source", "shapes", "fields", "description"}
        assert row["shapes"] == get_spec(row["name"]).shapes
        assert row["description"]
    assert by_name["soap"]["shapes"] == "2-D only"


# ---- dump-param-groups: the default config -------------------------------------------------


def test_dump_default_config_puts_matrices_in_group_0_and_biases_norms_in_a_wd0_group(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = dump_json(capsys, "--model", "gpt")
    assert "matched_rules" not in document  # only with --explain
    mapping = group_of(document)
    names = builtin_gpt_names()
    assert list(mapping) == [n for n, nd in names if nd >= 2] + [n for n, nd in names if nd < 2]
    assert {n for n, g in mapping.items() if g == 0} == {n for n, nd in names if nd >= 2}
    assert {n for n, g in mapping.items() if g == 1} == {n for n, nd in names if nd < 2}
    # By name, the routing a reader expects from the standard overrides:
    for matrix in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                   "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.1.mlp.linear_fc2.weight",
                   "output_layer.weight"):  # fmt: skip
        assert mapping[matrix] == 0
    for vector in ("decoder.layers.0.self_attention.linear_qkv.bias", "decoder.layers.0.input_layernorm.weight",
                   "decoder.layers.1.pre_mlp_layernorm.bias", "decoder.final_layernorm.weight"):  # fmt: skip
        assert mapping[vector] == 1

    group0, group1 = document["groups"]
    assert group0 == {
        "index": 0, "optimizer": "adam", "lr": 1e-3, "min_lr": None, "weight_decay": 0.01, "wd_mult": 1.0,
        "override": {}, "auto_routed": None, "num_params": 11, "num_elements": 475136,
    }  # fmt: skip
    assert group1 == {
        "index": 1, "optimizer": "adam", "lr": 1e-3, "min_lr": None, "weight_decay": 0.0, "wd_mult": 0.0,
        "override": {"wd_mult": 0.0}, "auto_routed": None, "num_params": 18, "num_elements": 3584,
    }  # fmt: skip


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_dump_table_has_one_row_per_group(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(capsys, "dump-param-groups", "--model", "gpt")
    lines = out.splitlines()
    assert lines[0].split() == ["group", "optimizer", "lr", "weight_decay", "other", "overrides", "params", "elements"]
    assert lines[2].split() == ["0", "adam", "0.001", "0.01", "-", "11", "475136"]
    assert lines[3].split() == ["1", "adam", "0.001", "0", "-", "18", "3584"]
    assert len(lines) == 4  # no per-parameter rows without --explain


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_explain_adds_one_row_per_parameter_with_matched_rules(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(capsys, "dump-param-groups", "--model", "gpt", "--explain")
    groups_table, explain_table = out.split("\n\n")
    assert len(groups_table.splitlines()) == 4
    header, rule, *rows = explain_table.splitlines()
    assert columns(header) == ["parameter", "group", "shape", "role", "matrices", "matched rules"]
    names = builtin_gpt_names()
    assert len(rows) == len(names)
    cells = {columns(row)[0]: columns(row)[1:] for row in rows}
    assert set(cells) == {n for n, _ in names}
    # optzoo/models.py: F.linear(x, linear_qkv.weight, bias), LayerNorm, position_embeddings(arange(...))
    assert cells["decoder.layers.0.self_attention.linear_qkv.weight"] == [
        "0", "384x128", "matrix (forward: addmm weight)", "-", "-",
    ]
    assert cells["decoder.final_layernorm.bias"] == [
        "1", "128", "norm (forward: a normalisation's weight or bias); elementwise (forward: native_layer_norm); bias (name)", "-", "#0 name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise')",
    ]
    assert cells["embedding.position_embeddings.weight"][2] == "embedding (forward: read by index (embedding))"


def test_explain_json_has_matched_rules_per_name(capsys: pytest.CaptureFixture[str]) -> None:
    document = dump_json(capsys, "--model", "gpt", "--explain")
    rules = document["matched_rules"]
    assert set(rules) == set(document["param_to_group"])
    assert rules["output_layer.weight"] == []
    assert rules["decoder.layers.1.mlp.linear_fc1.bias"] == ["#0 name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise')"]
    assert document["roles"]["output_layer.weight"] == {"output": "forward: mm weight, its product an output"}
    assert document["roles"]["decoder.final_layernorm.weight"] == {
        "norm": "forward: a normalisation's weight or bias", "elementwise": "forward: native_layer_norm",
    }


def test_tied_model_lists_both_names_of_the_tied_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    document = dump_json(capsys, "--model", "gpt-tied", "--explain")
    mapping = group_of(document)
    assert mapping["embedding.word_embeddings.weight"] == mapping["output_layer.weight"] == 0
    # The tensor is counted once: 10 matrices instead of the untied model's 11.
    assert document["groups"][0]["num_params"] == 10
    assert len(mapping) == 29  # but both of its names are listed, as in the untied model

    out = run_ok(capsys, "dump-param-groups", "--model", "gpt-tied", "--explain")
    explain = out.split("\n\n")[1]
    rows = {line.split()[0]: line.split()[1:3] for line in explain.splitlines()[2:]}
    assert rows["embedding.word_embeddings.weight"] == ["0", "256x128"]
    assert rows["output_layer.weight"] == ["0", "256x128"]


def test_qk_norm_model_keeps_qk_layernorms_out_of_decay_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    mapping = group_of(dump_json(capsys, "--model", "gpt-qk-norm"))
    assert mapping["decoder.layers.0.self_attention.q_layernorm.weight"] == 1
    assert mapping["decoder.layers.0.self_attention.k_layernorm.bias"] == 1


# ---- --config: TOML ------------------------------------------------------------------------


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_toml_config_with_name_globs_attr_and_a_lion_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "opt.toml", """
        [config]
        lr = 3e-4
        weight_decay = 0.1
        adam_beta2 = 0.95
        params_dtype = "bfloat16"

        [[overrides]]
        name = ["*.bias", "*layernorm*"]
        set = { wd_mult = 0.0 }

        [[overrides]]
        attr = "is_embedding_or_output_parameter"
        set = { max_lr = 1e-4 }

        [[overrides]]
        name = "decoder.layers.*.mlp.linear_fc*.weight"
        set = { optimizer = "lion", lr = 3e-5, lion_beta1 = 0.9 }
    """)
    document = dump_json(capsys, "--model", "gpt", "--config", config, "--explain")
    mapping = group_of(document)
    groups = document["groups"]
    assert [(g["optimizer"], g["lr"], g["weight_decay"]) for g in groups] == [
        ("adam", 3e-4, 0.1),
        ("adam", 1e-4, 0.1),
        ("adam", 3e-4, 0.0),
        ("lion", 3e-5, 0.1),
    ]
    assert groups[1]["override"] == {"max_lr": 1e-4}
    assert groups[3]["override"] == {"optimizer": "lion", "lr": 3e-5, "lion_beta1": 0.9}
    assert {n for n, g in mapping.items() if g == 0} == {
        f"decoder.layers.{i}.self_attention.{w}.weight" for i in (0, 1) for w in ("linear_qkv", "linear_proj")
    } | {"embedding.position_embeddings.weight"}
    assert {n for n, g in mapping.items() if g == 1} == {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert {n for n, g in mapping.items() if g == 3} == {
        f"decoder.layers.{i}.mlp.linear_fc{j}.weight" for i in (0, 1) for j in (1, 2)
    }
    assert mapping["decoder.layers.0.input_layernorm.weight"] == 2
    assert mapping["decoder.layers.1.mlp.linear_fc2.bias"] == 2
    assert document["matched_rules"]["decoder.layers.0.mlp.linear_fc1.weight"] == [
        "#2 name='decoder.layers.*.mlp.linear_fc*.weight'"
    ]
    # Issue 25: the standard overrides lie under the file's rules, and the provenance says so.
    assert document["matched_rules"]["decoder.final_layernorm.bias"] == [
        "#0 name=('*.bias', '*layernorm*')", "#3 name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise') (standard)",
    ]

    out = run_ok(capsys, "dump-param-groups", "--model", "gpt", "--config", config)
    lion_row = out.splitlines()[5].split()
    assert lion_row == ["3", "lion", "3e-05", "0.1", "lion_beta1=0.9", "4", "262144"]


def test_toml_without_overrides_means_standard_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "std.toml", """
        [config]
        lr = 2e-3
        decoupled_lr = 5e-4
    """)
    document = dump_json(capsys, "--model", "gpt", "--config", config)
    mapping = group_of(document)
    assert [g["override"] for g in document["groups"]] == [{}, {"max_lr": 5e-4}, {"wd_mult": 0.0}]
    assert [g["lr"] for g in document["groups"]] == [2e-3, 5e-4, 2e-3]
    assert mapping["embedding.word_embeddings.weight"] == mapping["output_layer.weight"] == 1
    assert mapping["decoder.final_layernorm.bias"] == 2


def test_toml_empty_overrides_means_no_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Issue 25: `[]` is "no overrides" under Megatron-Core's meaning, standard_overrides = false;
    # by default the standard overrides lie under it (tests/optzoo/test_overrides_layering.py).
    config = write_file(tmp_path, "none.toml", """
        overrides = []

        [config]
        lr = 2e-3
        decoupled_lr = 5e-4
        standard_overrides = false
    """)
    status, out, err = run(capsys, "dump-param-groups", "--model", "gpt", "--config", config, "--format", "json")
    assert status == 0
    # decoupled_lr acts only through the standard overrides, which `[]` switches off: say so.
    assert re.fullmatch(
        r"optzoo: warning: `OptimizerConfig.decoupled_lr`: has no effect with explicit config_overrides; "
        r"got 0.0005 but no override sets max_lr to it; .*\n", err
    )
    document = json.loads(out)
    assert len(document["groups"]) == 1
    assert document["groups"][0]["override"] == {}
    assert document["groups"][0]["weight_decay"] == 0.01
    assert set(group_of(document).values()) == {0}
    assert len(group_of(document)) == 29


def test_toml_dtype_fields_are_strings(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "dtype.toml", """
        [config]
        lr = 1e-3
        params_dtype = "bfloat16"
    """)
    assert len(dump_json(capsys, "--model", "gpt", "--config", config)["groups"]) == 2


# ---- --config: Python ----------------------------------------------------------------------


def test_python_config_file_with_config_and_config_overrides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "opt.py", """
        from optzoo import OptimizerConfig, ParamKey, ParamPredicate, get_standard_config_overrides

        config = OptimizerConfig(lr=1e-3, weight_decay=0.05)
        config_overrides = dict(get_standard_config_overrides(config))
        # An OptimizerConfig as an override means "its fields that differ from config".
        config_overrides[ParamKey(name="output_layer.weight")] = config.replace(optimizer="sgd", sgd_momentum=0.5)
        config_overrides[ParamKey(predicate=ParamPredicate(name="wide", fn=lambda p: p.shape[0] == 512))] = {
            "lr": 5e-4,
        }
    """)
    document = dump_json(capsys, "--model", "gpt", "--config", config)
    mapping = group_of(document)
    summary = [(g["optimizer"], g["lr"], g["weight_decay"], g["override"]) for g in document["groups"]]
    assert summary == [
        ("adam", 1e-3, 0.05, {}),
        ("adam", 1e-3, 0.0, {"wd_mult": 0.0}),
        ("adam", 5e-4, 0.05, {"lr": 5e-4}),
        ("adam", 5e-4, 0.0, {"wd_mult": 0.0, "lr": 5e-4}),
        ("sgd", 1e-3, 0.05, {"optimizer": "sgd", "sgd_momentum": 0.5}),
    ]
    assert mapping["decoder.layers.0.input_layernorm.weight"] == 1
    assert mapping["decoder.layers.0.mlp.linear_fc1.weight"] == 2
    assert mapping["decoder.layers.0.mlp.linear_fc1.bias"] == 3
    assert mapping["output_layer.weight"] == 4


def test_python_config_without_overrides_means_standard_and_empty_dict_means_none(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    standard = write_file(tmp_path, "standard.py", """
        from optzoo import OptimizerConfig
        config = OptimizerConfig(lr=1e-3)
    """)
    none = write_file(tmp_path, "none.py", """
        from optzoo import OptimizerConfig
        config = OptimizerConfig(lr=1e-3, standard_overrides=False)  # issue 25: {} is none under Megatron's meaning
        config_overrides = {}
    """)
    explicit_none = write_file(tmp_path, "explicit_none.py", """
        from optzoo import OptimizerConfig
        config = OptimizerConfig(lr=1e-3)
        config_overrides = None
    """)
    assert [g["override"] for g in dump_json(capsys, "--model", "gpt", "--config", standard)["groups"]] == [
        {}, {"wd_mult": 0.0},
    ]  # fmt: skip
    assert [g["override"] for g in dump_json(capsys, "--model", "gpt", "--config", explicit_none)["groups"]] == [
        {}, {"wd_mult": 0.0},
    ]  # fmt: skip
    assert [g["override"] for g in dump_json(capsys, "--model", "gpt", "--config", none)["groups"]] == [{}]


# ---- --model package.module:callable -------------------------------------------------------


def test_model_from_module_callable(capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]) -> None:
    module = write_module("""
        from torch import nn

        def build():
            return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))
    """)
    document = dump_json(capsys, "--model", f"{module}:build")
    assert group_of(document) == {"0.weight": 0, "2.weight": 0, "0.bias": 1, "1.weight": 1, "1.bias": 1}


TWO_INPUTS = """
    import torch
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(1, 8, 16))  # a bare table
            self.body = nn.Linear(16, 16)
            self.qa = nn.Linear(16, 2)

        def forward(self, x, mask):
            h = torch.where(mask[..., None], x, x + self.pos)
            return self.qa(h + self.body(h))

    def build():
        return Model()
"""


def test_example_inputs_let_the_forward_say_what_each_parameter_is(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module(TWO_INPUTS)
    status, out, err = run(capsys, "dump-param-groups", "--model", f"{module}:build", "--format", "json", "--explain")
    assert status == 0 and err == (
        "optzoo: warning: `Model`: roles guessed from module types and names; could not observe its forward: "
        "Model.forward takes 2 positional inputs; expected inputs for one forward: pass example_inputs= to "
        "get_optimizer or resolve_param_groups (a tensor, a tuple of inputs or a dict of keyword inputs; only shapes "
        "and dtypes matter), or --example-inputs to the optzoo command\n"
    )  # fmt: skip
    assert json.loads(out)["roles"]["pos"] == {"matrix": "3-D", "guessed": "no forward use observed: module types, names and shapes"}
    document = dump_json(capsys, "--model", f"{module}:build", "--explain", "--example-inputs", "x=1x8x16,mask=1x8:bool")
    assert {name: sorted(roles) for name, roles in document["roles"].items()} == {
        "pos": ["embedding"], "body.weight": ["matrix"], "body.bias": ["bias"], "qa.weight": ["output"], "qa.bias": ["bias"],
    }


def test_no_trace_guesses_and_a_bad_example_inputs_spec_is_an_error(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module(TWO_INPUTS)
    document = dump_json(capsys, "--model", f"{module}:build", "--explain", "--no-trace")
    assert document["roles"]["qa.weight"] == {"matrix": "2-D", "guessed": "no forward use observed: module types, names and shapes"}
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--example-inputs", "tokens=1xten")
    assert line == (
        "optzoo: error: `--example-inputs`: not a shape; got 'tokens=1xten'; expected [name=]SHAPE[:dtype] such as "
        "input_ids=1x16:int64"
    )
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--example-inputs", "1x16:int65")
    assert line == (
        "optzoo: error: `--example-inputs`: bad dtype or size; got '1x16:int65'; expected a torch dtype name (float32, "
        "int64, bfloat16, ...) and sizes >= 0"
    )


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_model_callable_returning_chunks_gets_chunk_qualified_names(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module("""
        from torch import nn

        def build():
            return [nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))]
    """)
    document = dump_json(capsys, "--model", f"{module}:build", "--explain")
    assert group_of(document) == {
        "chunk0.0.weight": 0, "chunk1.1.weight": 0,
        "chunk0.0.bias": 1, "chunk1.0.weight": 1, "chunk1.0.bias": 1, "chunk1.1.bias": 1,
    }  # fmt: skip
    out = run_ok(capsys, "dump-param-groups", "--model", f"{module}:build", "--explain")
    explain_names = [line.split()[0] for line in out.split("\n\n")[1].splitlines()[2:]]
    assert explain_names == ["chunk0.0.weight", "chunk1.1.weight", "chunk0.0.bias", "chunk1.0.weight",
                             "chunk1.0.bias", "chunk1.1.bias"]  # fmt: skip


def test_name_globs_match_chunk_local_names(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, write_module: Callable[[str], str]
) -> None:
    module = write_module("""
        from torch import nn

        def build():
            return [nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)]
    """)
    config = write_file(tmp_path, "local.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "weight"
        set = { lr = 1e-2 }
    """)
    document = dump_json(capsys, "--model", f"{module}:build", "--config", config)
    assert group_of(document) == {"chunk0.weight": 0, "chunk1.weight": 0}
    assert document["groups"][0]["lr"] == 1e-2


def test_tensor_tied_across_chunks_is_listed_under_each_chunks_name(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    """Megatron's first and last pipeline chunks share the word embedding with the output layer.

    The tied tensor has the name ``embedding.weight`` in chunk 0 and ``head.weight`` in chunk 1,
    so its chunk-qualified names are ``chunk0.embedding.weight`` and ``chunk1.head.weight``.
    """
    module = write_module("""
        from torch import nn

        class First(nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding = nn.Embedding(8, 4)

        class Last(nn.Module):
            def __init__(self, weight):
                super().__init__()
                self.head = nn.Linear(4, 8, bias=False)
                self.head.weight = weight

        def build():
            first = First()
            return [first, Last(first.embedding.weight)]
    """)
    status, out, err = run(capsys, "dump-param-groups", "--model", f"{module}:build", "--format", "json")
    assert status == 0, err
    assert set(json.loads(out)["param_to_group"]) == {"chunk0.embedding.weight", "chunk1.head.weight"}


def test_tensor_tied_across_chunks_under_the_same_local_name_keeps_both_names(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module("""
        from torch import nn

        def build():
            first, last = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
            last.weight = first.weight
            return [first, last]
    """)
    status, out, err = run(capsys, "dump-param-groups", "--model", f"{module}:build", "--format", "json")
    assert status == 0, err
    assert set(json.loads(out)["param_to_group"]) == {"chunk0.weight", "chunk1.weight"}


# ---- warnings ------------------------------------------------------------------------------


def test_rule_matching_nothing_warns_on_stderr_and_succeeds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "unmatched.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "encoder.*"
        set = { lr = 1e-2 }
    """)
    status, out, err = run(capsys, "dump-param-groups", "--model", "gpt", "--config", config, "--format", "json")
    assert status == 0
    assert json.loads(out)["groups"][0]["override"] == {}  # stdout stays valid JSON
    lines = err.splitlines()
    assert len(lines) == 1
    assert re.match(r"optzoo: warning: config_overrides: rule #0 name='encoder\.\*' matched no parameter; "
                    r"parameters are: embedding\.word_embeddings\.weight, .*\(\+19 more\)$", lines[0])  # fmt: skip


# ---- bad input: one line, status 2 ---------------------------------------------------------


def test_unknown_model(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "gtp")
    assert re.fullmatch(
        r"optzoo: error: `--model`: unknown model; got 'gtp'; expected one of \['gpt', .*\] "
        r"or package\.module:callable; did you mean 'gpt'\?",  # issue 25: the close match
        line,
    )


def test_model_module_that_cannot_be_imported(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "nonexistent_mod:fn")
    assert re.fullmatch(r"optzoo: error: `--model`: cannot import; got No module named 'nonexistent_mod'", line)


def test_model_module_without_the_attribute(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module("def build():\n    raise AssertionError('never called')\n")
    line = run_error(capsys, "dump-param-groups", "--model", f"{module}:missing")
    assert re.fullmatch(
        rf"optzoo: error: `--model`: module '{module}' has no attribute 'missing'; got '{module}:missing'; "
        r"expected package\.module:callable",
        line,
    )


def test_model_malformed_spec(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", ":build")
    assert re.fullmatch(r"optzoo: error: `--model`: malformed spec; got ':build'; expected package\.module:callable",
                        line)  # fmt: skip


def test_model_callable_returning_something_else(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    module = write_module("def build():\n    return 42\n")
    line = run_error(capsys, "dump-param-groups", "--model", f"{module}:build")
    assert re.fullmatch(
        rf"optzoo: error: `--model`: '{module}:build' returned int; expected a torch\.nn\.Module or a list of modules",
        line,
    )


def test_model_attribute_that_is_not_callable_names_the_flag(
    capsys: pytest.CaptureFixture[str], write_module: Callable[[str], str]
) -> None:
    """Like every other bad ``--model``, the message names the flag and the spec (STYLE 14)."""
    module = write_module("VOCAB_SIZE = 256\n")
    line = run_error(capsys, "dump-param-groups", "--model", f"{module}:VOCAB_SIZE")
    assert re.match(rf"optzoo: error: `--model`: .*; got '{module}:VOCAB_SIZE'", line), line


def test_missing_config_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--config", missing)
    assert line == f"optzoo: error: `--config`: no such file; got {missing!r}; expected a .toml or .py file"


# Each case: a config file, extra flags, and the one stderr line it must produce in full
# ("{config}" stands for the file's path). Status 2 and no traceback are checked by run_error.
BAD_CONFIGS = [
    pytest.param("bad.toml", "[config]\nlr = = 1\n", (),
                 r"optzoo: error: `{config}`: invalid TOML; got .*\(at line 2, column \d+\); expected a TOML document",
                 id="invalid-toml"),
    pytest.param("field.toml", "[config]\nlr = 1e-3\nlearning_rate = 1e-3\n", (),
                 r"optzoo: error: `config\.learning_rate`: unknown OptimizerConfig field; "
                 r"got 'learning_rate'; expected one of \['lr', 'min_lr', .*\]",
                 id="unknown-config-field"),
    pytest.param("top.toml", "[optimizer]\nlr = 1e-3\n", (),
                 r"optzoo: error: `{config}`: unknown top-level key; got 'optimizer'; expected 'config' and 'overrides'",
                 id="unknown-top-level-key"),
    pytest.param("override.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "*.bias"
        set = { weight_decay_mult = 0.0 }
    """, (), r"optzoo: error: `config_overrides rule #0 name='\*\.bias'`: unknown override field; "
             r"got 'weight_decay_mult'; expected one of \['lr', .*'wd_mult', .*\]; did you mean 'weight_decay'\?",
                 id="unknown-override-field"),
    pytest.param("model_wide.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "*.bias"
        set = { clip_grad = 0.5 }
    """, (), r"optzoo: error: .*: field is model-wide and cannot differ per group; got 'clip_grad'.*",
                 id="model-wide-field-in-an-override"),
    pytest.param("table.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        names = "*.bias"
        set = { wd_mult = 0.0 }
    """, (), re.escape("optzoo: error: `overrides[0].names`: unknown key; got 'names'; expected one of ['name', 'attr', 'predicate', 'with_name_predicate', 'role', 'exclude_name', 'exclude_attr', 'exclude_predicate', 'exclude_with_name_predicate', 'exclude_role', 'set']; did you mean 'name'?"),
                 id="unknown-key-in-an-overrides-table"),
    pytest.param("conflict.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "*.bias"
        set = { lr = 1e-4 }
        [[overrides]]
        name = "*.linear_qkv.*"
        set = { lr = 2e-4 }
    """, (), re.escape(
        "optzoo: error: `decoder.layers.0.self_attention.linear_qkv.bias`: conflicting values for field `lr` "
        "from rule #0 name='*.bias' (lr=0.0001) and rule #1 name='*.linear_qkv.*' (lr=0.0002); "
        "expected matching rules to agree: narrow one rule or make the values equal"
    ), id="conflicting-overrides"),
    pytest.param("strict.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        name = "*.bias"
        set = { wd_mult = 0.0 }
        [[overrides]]
        name = "encoder.*"
        set = { lr = 1e-2 }
    """, ("--strict",), r"optzoo: error: config_overrides: rule #1 name='encoder\.\*' matched no parameter; "
                        r"parameters are: .*; expected every rule to match \(strict=True\)",
                 id="strict-with-a-rule-that-matches-nothing"),
    pytest.param("graph.toml", "[config]\nlr = 1e-3\noptimizer_cuda_graph = true\n", (),
                 re.escape("optzoo: error: `OptimizerConfig.optimizer_cuda_graph`: not supported: CUDA-graph capture "
                           "of the step is not implemented; got True; expected False"),
                 id="unsupported-config-flag"),
    pytest.param("no_lr.toml", "[config]\nweight_decay = 0.1\n", (),
                 r"optzoo: error: `OptimizerConfig\.lr`: required to build an optimizer; got None.*",
                 id="config-without-lr"),
    # A quoted number in TOML is a string; the message must say which field is wrong (STYLE 14).
    pytest.param("typed.toml", '[config]\nlr = "3e-4"\n', (),
                 r"optzoo: error: `(OptimizerConfig|config)\.lr`: .*; got '3e-4'.*",
                 id="config-value-of-the-wrong-type-names-the-field"),
    pytest.param("empty.py", "lr = 1e-3\n", (),
                 r"optzoo: error: `{config}`: must define `config` as an OptimizerConfig; got NoneType; "
                 r"expected config = OptimizerConfig\(\.\.\.\)",
                 id="python-config-file-without-config"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "flags", "expected"), BAD_CONFIGS)
def test_bad_config_file_gives_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, text: str, flags: tuple[str, ...], expected: str
) -> None:
    config = write_file(tmp_path, name, text)
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--config", config, *flags)
    assert re.fullmatch(expected.replace("{config}", re.escape(config)), line), line


# ---- argparse errors: SystemExit(2) --------------------------------------------------------


def test_unknown_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_usage_error(capsys, "dump-groups")
    assert re.fullmatch(r"optzoo: error: argument command: invalid choice: 'dump-groups' \(choose from .*\); "
                        r"did you mean 'dump-param-groups'\? \(see `optzoo --help`\)", line)  # fmt: skip


def test_no_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_usage_error(capsys)
    assert line == "optzoo: error: the following arguments are required: command (see `optzoo --help`)"


def test_missing_model(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_usage_error(capsys, "dump-param-groups", "--explain")
    assert line == ("optzoo: error: the following arguments are required: --model "
                    "(see `optzoo dump-param-groups --help`)")  # fmt: skip


def test_bad_format_choice(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_usage_error(capsys, "list", "--format", "yaml")
    assert re.fullmatch(r"optzoo: error: argument --format: invalid choice: 'yaml' .*", line)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dump-param-groups", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--config", "--explain", "--format", "--strict"):
        assert flag in out


# ---- the real entry points -----------------------------------------------------------------


def test_console_script_points_at_main() -> None:
    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts["optzoo"] == "optzoo.cli:main"


def test_python_dash_m_runs_the_cli_and_returns_its_status(tmp_path: Path) -> None:
    """``python -m optzoo.cli`` goes through ``if __name__ == "__main__"`` and ``sys.exit(main())``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    ok = subprocess.run([sys.executable, "-m", "optzoo.cli", "list", "--format", "json"],
                        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert [row["name"] for row in json.loads(ok.stdout)] == registered_names()

    bad = subprocess.run([sys.executable, "-m", "optzoo.cli", "dump-param-groups", "--model", "gtp"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert [line for line in bad.stderr.splitlines() if line.startswith("optzoo:")] == bad.stderr.splitlines()[-1:]
    assert bad.stderr.splitlines()[-1].startswith("optzoo: error: `--model`: unknown model; got 'gtp'")


# ---- dump-param-groups --world-size: the distributed optimizer's plan ----------------------

GPT_ELEMENTS = 478720  # 475136 in the matrices + 3584 in biases and norms (the group table above)
GPT_MATRICES = {n for n, nd in builtin_gpt_names() if nd == 2}


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    document = dump_json(capsys, "--model", "gpt", *argv)
    assert set(document["owners"]) == set(document["param_to_group"])  # every name has owners
    ranks = document["ranks"]
    assert [r["rank"] for r in ranks] == list(range(document["world_size"]))
    assert sum(r["share"] for r in ranks) == pytest.approx(1.0)
    return document


def numel_of(name: str) -> int:
    with torch.device("meta"):
        return dict(GPT(GPTConfig()).named_parameters())[name].numel()


def test_layer_wise_plan_gives_every_param_one_owner_and_balances_adam_elements(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = plan_json(capsys, "--world-size", "2")
    assert document["distributed_mode"] == "layer_wise"  # the default without a config flag
    owners = document["owners"]
    for name, pieces in owners.items():
        assert pieces == [{"rank": pieces[0]["rank"], "start": 0, "stop": numel_of(name)}], name
    # Largest first to the least-loaded rank: rank 0 takes the embeddings, both linear_fc1, one
    # qkv and one proj (245760 elements); rank 1 the rest, with every vector.
    on_rank_0 = {n for n, pieces in owners.items() if pieces[0]["rank"] == 0}
    assert on_rank_0 == {
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc1.weight", "decoder.layers.1.self_attention.linear_proj.weight",
    }  # fmt: skip
    ranks = document["ranks"]
    assert [r["params"] for r in ranks] == [6, 23]
    assert [r["state_elements"] for r in ranks] == [245760, 232960]
    # Adam costs 10 FLOPs per element, so the loads are 10x the elements and sum to the whole model's.
    assert [r["load_flops"] for r in ranks] == [2457600.0, 2329600.0]
    assert sum(r["load_flops"] for r in ranks) == 10 * GPT_ELEMENTS


@pytest.mark.parametrize(("world", "elements"), [(2, [239360, 239360]), (3, [159573, 159573, 159574])])
def test_sharded_plan_cuts_adam_params_into_ranges_that_differ_by_at_most_one_element(
    capsys: pytest.CaptureFixture[str], world: int, elements: list[int]
) -> None:
    document = plan_json(capsys, "--world-size", str(world), "--distributed-mode", "sharded")
    assert document["distributed_mode"] == "sharded"
    assert [r["state_elements"] for r in document["ranks"]] == elements
    assert sum(elements) == GPT_ELEMENTS
    # Each param's pieces tile it in order; ranks take the flat sequence in rank order.
    flat_ranks = []
    for name, pieces in document["owners"].items():
        assert pieces[0]["start"] == 0 and pieces[-1]["stop"] == numel_of(name), name
        assert all(a["stop"] == b["start"] and a["rank"] < b["rank"] for a, b in itertools.pairwise(pieces)), name
        flat_ranks += [p["rank"] for p in pieces]
    assert flat_ranks == sorted(flat_ranks)
    assert sum(len(pieces) - 1 for pieces in document["owners"].values()) == world - 1  # one cut per boundary


def test_sharded_config_flag_selects_the_sharded_plan_and_keeps_muon_matrices_whole(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = write_file(tmp_path, "zero.toml", """
        [config]
        lr = 1e-3
        optimizer = "muon"
        use_distributed_optimizer = true
    """)
    document = plan_json(capsys, "--config", config, "--world-size", "2")
    assert document["distributed_mode"] == "sharded"
    owners = document["owners"]
    muon = {n for n, g in group_of(document).items() if document["groups"][g]["optimizer"] == "muon"}
    # Muon hands the input tables (the tagged word embedding, the position table the forward reads
    # by index) and the output layer to Adam itself.
    assert muon == GPT_MATRICES - {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight"}
    assert all(len(owners[n]) == 1 for n in muon)
    assert sum(len(pieces) for pieces in owners.values()) > len(owners)  # some Adam param is split
    # The explicit flag wins over the config's, with a warning saying so.
    status, out, err = run(capsys, "dump-param-groups", "--model", "gpt", "--config", config,
                           "--world-size", "2", "--distributed-mode", "layer_wise", "--format", "json")  # fmt: skip
    assert status == 0
    assert err == ("optzoo: warning: `--distributed-mode layer_wise` overrides the config's "
                   "use_distributed_optimizer=True; showing the layer_wise plan\n")  # fmt: skip
    assert json.loads(out)["distributed_mode"] == "layer_wise"


def test_plan_on_the_meta_device_equals_plan_shards_on_real_tensors(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The CLI plans on the meta device; param_cost reads only shapes, so real tensors agree."""
    config = write_file(tmp_path, "muon.toml", '[config]\nlr = 1e-3\noptimizer = "muon"\n')
    groups, _ = resolve_group_configs(OptimizerConfig(lr=1e-3, optimizer="muon"), [GPT(GPTConfig())], None)
    for mode in ("layer_wise", "sharded"):
        plan = plan_shards(groups, 3, mode)
        document = plan_json(capsys, "--config", config, "--world-size", "3", "--distributed-mode", mode)
        assert [r["load_flops"] for r in document["ranks"]] == plan.loads()
        assert [r["state_elements"] for r in document["ranks"]] == plan.state_elements()
        assert {n: [p["rank"] for p in pieces] for n, pieces in document["owners"].items()} == plan.owners()
        assert len(set(plan.loads())) > 1  # Newton-Schulz costs, not a per-element count


def test_tied_names_share_their_tensors_owner(capsys: pytest.CaptureFixture[str]) -> None:
    document = dump_json(capsys, "--model", "gpt-tied", "--world-size", "2")
    owners = document["owners"]
    assert owners["output_layer.weight"] == owners["embedding.word_embeddings.weight"] == [
        {"rank": 0, "start": 0, "stop": 256 * 128}
    ]
    assert sum(r["params"] for r in document["ranks"]) == 28  # the tied tensor counted once
    assert sum(r["state_elements"] for r in document["ranks"]) == GPT_ELEMENTS - 256 * 128


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_world_size_table_adds_an_owner_column_and_a_per_rank_summary(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(capsys, "dump-param-groups", "--model", "gpt", "--world-size", "2", "--distributed-mode", "sharded")
    groups_table, params_table, summary = out.split("\n\n")
    assert len(groups_table.splitlines()) == 4
    header, _, *rows = params_table.splitlines()
    assert header.split() == ["parameter", "group", "shape", "owner"]
    owners = {row.split()[0]: row.split(maxsplit=3)[3] for row in rows}
    assert len(owners) == 29
    assert owners["decoder.layers.0.mlp.linear_fc2.weight"] == "0[0:59136] 1[59136:65536]"
    assert owners["decoder.layers.0.mlp.linear_fc1.weight"] == "0"
    assert owners["decoder.final_layernorm.bias"] == "1"
    assert summary.splitlines() == [
        "sharded plan over 2 ranks:",
        "  rank    params owned    state elements    load (GFLOP/step)    share (%)",
        "------  --------------  ----------------  -------------------  -----------",
        "     0               6            239360             0.002394         50.0",
        "     1              24            239360             0.002394         50.0",
    ]


@pytest.mark.usefixtures("wide_terminal")  # the one-line rows of a wide terminal
def test_world_size_with_explain_puts_the_owner_after_the_matched_rules(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_ok(capsys, "dump-param-groups", "--model", "gpt", "--world-size", "2", "--explain")
    header, _, *rows = out.split("\n\n")[1].splitlines()
    assert columns(header) == ["parameter", "group", "shape", "role", "matrices", "matched rules", "owner"]
    row = next(r for r in rows if r.startswith("decoder.final_layernorm.bias "))
    assert columns(row)[-1] == "1"
    assert columns(row)[-2] == "#0 name='*.bias', predicate='is_1d', role=('bias', 'norm', 'elementwise')"


@pytest.mark.parametrize("world", ["0", "-2"])
def test_world_size_below_one_is_an_error(capsys: pytest.CaptureFixture[str], world: str) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--world-size", world)
    assert line == f"optzoo: error: `--world-size`: out of range; got {world}; expected an integer in [1, 1048576]"


def test_distributed_mode_without_world_size_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--distributed-mode", "sharded")
    assert line == ("optzoo: error: `--distributed-mode`: needs --world-size; got --distributed-mode sharded "
                    "without it; expected --world-size N as well")  # fmt: skip


@pytest.mark.parametrize(("argv", "expected"), [
    (("--world-size", "two"), r"optzoo: error: argument --world-size: invalid int value: 'two' .*"),
    (("--world-size", "2", "--distributed-mode", "zero1"), r"optzoo: error: argument --distributed-mode: invalid choice: 'zero1' .*"),
])  # fmt: skip
def test_bad_world_size_or_mode_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], expected: str
) -> None:
    line = run_usage_error(capsys, "dump-param-groups", "--model", "gpt", *argv)
    assert re.fullmatch(expected, line), line


# ---- lint ----------------------------------------------------------------------------------

SHADOWED_BIAS_RULE = """
    [config]
    lr = 1e-3
    weight_decay = 0.1

    [[overrides]]
    predicate = "is_1d"
    role = ["bias", "norm"]
    set = { wd_mult = 0.0 }

    [[overrides]]
    name = "*.bias"
    set = { wd_mult = 0.0 }
"""
SHADOWED_MESSAGE = (
    "lint: shadowed-rule: rule #1 name='*.bias': changes nothing; got {'wd_mult': 0.0} on "
    "`decoder.layers.0.input_layernorm.bias`, `decoder.layers.0.self_attention.linear_qkv.bias`, "
    "`decoder.layers.0.self_attention.linear_proj.bias`, `decoder.layers.0.pre_mlp_layernorm.bias`, "
    "`decoder.layers.0.mlp.linear_fc1.bias`, `decoder.layers.0.mlp.linear_fc2.bias`, "
    "`decoder.layers.1.input_layernorm.bias`, `decoder.layers.1.self_attention.linear_qkv.bias`, "
    "`decoder.layers.1.self_attention.linear_proj.bias`, `decoder.layers.1.pre_mlp_layernorm.bias`, ... (+3 more), "
    "all of it set already by rule #0 predicate='is_1d', role=('bias', 'norm'); expected it removed, or narrowed to "
    "the params it is meant for"
)


def test_lint_prints_each_finding_and_a_count(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "shadowed.toml", SHADOWED_BIAS_RULE)
    assert unwrap(run_ok(capsys, "lint", "--model", "gpt", "--config", config)).splitlines() == [SHADOWED_MESSAGE, "1 finding"]
    assert run_ok(capsys, "lint", "--model", "gpt").splitlines() == ["0 findings"]


def test_lint_strict_exits_with_its_own_status_when_it_finds_something(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "shadowed.toml", SHADOWED_BIAS_RULE)
    status, out, err = run(capsys, "lint", "--model", "gpt", "--config", config, "--strict")
    assert (status, err) == (LINT_EXIT_STATUS, "") and LINT_EXIT_STATUS == 3
    assert out.splitlines()[-1] == "1 finding"
    assert run(capsys, "lint", "--model", "gpt", "--strict") == (0, "0 findings\n", "")


def test_lint_json_lists_kind_params_and_message(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "shadowed.toml", SHADOWED_BIAS_RULE)
    document = json.loads(run_ok(capsys, "lint", "--model", "gpt", "--config", config, "--format", "json"))
    assert [(f["kind"], len(f["params"]), "lint: shadowed-rule: " + f["message"]) for f in document] == [
        ("shadowed-rule", 13, SHADOWED_MESSAGE),
    ]


def test_dump_param_groups_lint_adds_the_findings_after_the_tables(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "shadowed.toml", SHADOWED_BIAS_RULE)
    out = run_ok(capsys, "dump-param-groups", "--model", "gpt", "--config", config, "--lint")
    groups_table, lint = out.split("\n\n")
    assert len(groups_table.splitlines()) == 4
    assert unwrap(lint).splitlines() == [SHADOWED_MESSAGE, "1 lint finding"]
    status, _, _ = run(capsys, "dump-param-groups", "--model", "gpt", "--config", config, "--lint", "--strict")
    assert status == LINT_EXIT_STATUS
    document = dump_json(capsys, "--model", "gpt", "--config", config, "--lint")
    assert [f["kind"] for f in document["lint"]] == ["shadowed-rule"]
    assert "lint" not in dump_json(capsys, "--model", "gpt")


def test_lint_on_a_hugging_face_model_with_a_rule_that_sends_every_matrix_to_muon(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = write_file(tmp_path, "all2d.toml", """
        [config]
        lr = 1e-3
        [[overrides]]
        predicate = "is_2d_matrix"
        set = { optimizer = "muon" }
        [[overrides]]
        predicate = "is_1d"
        role = ["bias", "norm"]
        set = { wd_mult = 0.0 }
    """)
    lines = unwrap(run_ok(capsys, "lint", "--model", "hf:LlamaConfig", "--config", config)).splitlines()
    assert lines == [
        "lint: embedding-on-matrix-optimizer: `model.embed_tokens.weight`, `lm_head.weight`: input table or head "
        "routed to muon by rule #0 predicate='is_2d_matrix'; got param group #0 (muon); expected them on the scalar "
        "optimizer (adam), where tables and heads train better: leave `model.embed_tokens.weight`, `lm_head.weight` "
        "out of rule #0 predicate='is_2d_matrix' (exclude them)",
        "1 finding",
    ]


def test_expert_world_size_plans_the_experts_over_their_own_group(capsys: pytest.CaptureFixture[str]) -> None:
    """A Qwen2-MoE's expert stacks get their own plan over 2 expert data-parallel ranks; everything
    else is planned over the 4 data-parallel ranks (as get_optimizer(expert_process_group=...))."""
    document = dump_json(capsys, "--model", "hf:Qwen2MoeConfig", "--config", "muon-llm", "--world-size", "4", "--expert-world-size", "2")
    experts = {name for name in document["owners"] if ".mlp.experts." in name}
    assert experts and document["expert_world_size"] == 2 and len(document["expert_ranks"]) == 2
    assert {piece["rank"] for name in experts for piece in document["owners"][name]} == {0, 1}
    dense_ranks = {piece["rank"] for name, pieces in document["owners"].items() if name not in experts for piece in pieces}
    assert dense_ranks == {0, 1, 2, 3}
    assert sum(r["share"] for r in document["expert_ranks"]) == pytest.approx(1.0)
    assert sum(r["share"] for r in document["ranks"]) == pytest.approx(1.0)


@pytest.mark.parametrize(("argv", "got"), [(["--world-size", "4", "--expert-world-size", "3"], "got 3 with --world-size 4"),
                                           (["--expert-world-size", "2"], "got 2 with --world-size None")])  # fmt: skip
def test_expert_world_size_must_divide_the_world_size(capsys: pytest.CaptureFixture[str], argv: list[str], got: str) -> None:
    assert main(["dump-param-groups", "--model", "gpt", *argv]) == 2
    assert re.search(r"optzoo: error: `--expert-world-size`: must divide --world-size .*; " + re.escape(got), capsys.readouterr().err)



# ---- issue 15, item 13: one error line, exit 2 ---------------------------------------------------


def _module(tmp_path: Path, name: str, source: str) -> str:
    (tmp_path / f"{name}.py").write_text(source)
    return name


@pytest.mark.parametrize(
    ("source", "got"),
    [
        ("raise RuntimeError('boom')\n", r"RuntimeError: boom"),
        ("def broken(:\n", r"SyntaxError: "),
        ("import sys\nsys.exit(3)\n", r"SystemExit: 3"),
    ],
    ids=["raises", "syntax-error", "sys-exit"],
)
def test_item13_a_model_module_that_fails_at_import_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, got: str
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _module(tmp_path, f"bad_model_{abs(hash(source))}", source)
    line = run_error(capsys, "dump-param-groups", "--model", f"{name}:build")
    assert re.fullmatch(rf"optzoo: error: `--model`: importing '{name}' failed; got {got}.*; expected a module that imports cleanly", line)


def test_item13_a_model_without_trainable_params_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    name = _module(tmp_path, "frozen_model", "import torch\ndef build():\n    return torch.nn.Linear(2, 2).requires_grad_(False)\n")
    line = run_error(capsys, "dump-param-groups", "--model", f"{name}:build")
    assert line == f"optzoo: error: `--model`: no trainable parameters; got '{name}:build'; expected a model with at least one"


def test_item13_config_paths_that_cannot_be_read_are_one_error_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--config", "x" * 5000 + ".toml")
    assert re.fullmatch(r"optzoo: error: `--config`: cannot be read; got 'x{80}': File name too long; expected a readable file", line)
    latin = tmp_path / "latin.toml"
    latin.write_bytes("lr = 1e-3 # caf\xe9\n".encode("latin-1"))
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--config", str(latin))
    assert re.fullmatch(rf"optzoo: error: `--config`: not UTF-8 text; got {re.escape(repr(str(latin)))} \(invalid .*\); expected a text file", line)


def test_item13_a_huge_world_size_and_negative_demo_steps_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--world-size", str(10**30))
    assert line == "optzoo: error: `--world-size`: out of range; got an int of 31 digits; expected an integer in [1, 1048576]"
    line = run_usage_error(capsys, "demo", "--steps", "-1")
    assert line == "optzoo: error: argument --steps: must be at least 1; got -1 (see `optzoo demo --help`)"


# ---- issue 25: --version, recipes, did you mean, hf: forms, module:callable from here ------


def test_version_names_optzoo_torch_and_emerging_optimizers(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    python = ".".join(map(str, sys.version_info[:3]))
    assert capsys.readouterr().out == (
        f"optzoo {version('optzoo')} (torch {torch.__version__}, "
        f"emerging-optimizers {version('emerging-optimizers')}, Python {python})\n"
    )


def test_recipes_lists_each_shipped_file_with_its_first_comment_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    folder = Path(__file__).resolve().parents[2] / "optzoo" / "recipes"
    expected = {p.stem: p.read_text().splitlines()[0].removeprefix("# ") for p in sorted(folder.glob("*.toml"))}
    assert set(expected) >= {"muon-llm", "lion-llm", "adamw-no-decay-norms"}
    assert json.loads(run_ok(capsys, "recipes", "--format", "json")) == [
        {"name": name, "description": text} for name, text in expected.items()
    ]
    monkeypatch.setenv("COLUMNS", "1000")
    header, rule, *rows = run_ok(capsys, "recipes").splitlines()
    assert header.split() == ["recipe", "description"]
    assert [row.split(maxsplit=1) for row in rows] == [[name, text] for name, text in expected.items()]


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["lst"], "did you mean 'list'?"),
        (["recipe"], "did you mean 'recipes'?"),
        (["dump-param-groups", "--model", "gpt", "--explian"], "did you mean '--explain'?"),
        (["list", "--feilds"], "did you mean '--fields'?"),
        (["dump-param-groups", "--model", "gtp"], "did you mean 'gpt'?"),
        (["dump-param-groups", "--model", "gpt", "--config", "muon-lm"], "did you mean 'muon-llm'?"),
        (["dump-param-groups", "--model", "hf:LlamaConfg"], "did you mean 'LlamaConfig'?"),
        (["dump-param-groups", "--model", "hf:T5Config:AutoModelForSeq2SeqLMM"], "did you mean 'AutoModelForSeq2SeqLM'?"),
    ],
)
def test_a_misspelt_name_gets_the_close_match(capsys: pytest.CaptureFixture[str], argv: list[str], hint: str) -> None:
    try:
        status = main(argv)
    except SystemExit as exited:
        status = exited.code  # type: ignore[assignment]
    line = assert_one_error_line(capsys.readouterr().err)
    assert status == 2
    assert hint in line, line


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ('[config]\nlr = 1e-3\noptimizer = "muom"\n', "; did you mean 'muon'?"),
        ("[config]\nlr = 1e-3\nweight_decy = 0.1\n", "; did you mean 'weight_decay'?"),
        ('[config]\nlr = 1e-3\nmuon_scale_mode = "spectrl"\n', "; did you mean 'spectral'?"),
        ('[config]\nlr = 1e-3\n[[overrides]]\nname = "*.bias"\nset = { wd_mul = 0.0 }\n', "; did you mean 'wd_mult'?"),
        ('[config]\nlr = 1e-3\n[[overrides]]\npredicate = "is_1D"\nset = { wd_mult = 0.0 }\n', "; did you mean 'is_1d'?"),
        ('[config]\nlr = 1e-3\n[[overrides]]\nexclude_nam = "*.bias"\nname = "*"\nset = { wd_mult = 0.0 }\n', "; did you mean 'exclude_name'?"),
    ],
    ids=["optimizer", "config-field", "value", "override-field", "predicate", "entry-key"],
)
def test_a_misspelt_config_file_gets_the_close_match(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, hint: str) -> None:
    config = write_file(tmp_path, "typo.toml", text)
    line = run_error(capsys, "dump-param-groups", "--model", "gpt", "--config", config)
    assert line.endswith(hint), line


def test_the_python_api_suggests_too() -> None:
    with pytest.raises(TypeError, match=r"^OptimizerConfig.__init__\(\) got an unexpected keyword argument 'weight_decy'; "
                                        r"did you mean 'weight_decay'\?$"):  # fmt: skip
        OptimizerConfig(lr=1e-3, weight_decy=0.1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'lrr'; did you mean 'lr'\?$"):
        OptimizerConfig(lr=1e-3).replace(lrr=1.0)
    with pytest.raises(ValueError, match=r"^`OptimizerConfig.optimizer`: unknown optimizer; got 'muom'; expected one of .*; did you mean 'muon'\?$"):
        OptimizerConfig(lr=1e-3, optimizer="muom")  # "Muon" itself is taken: names are read in any case
    with pytest.raises(ValueError, match=r"^`optimizer`: unknown optimizer; got 'lino'; expected one of .*; did you mean 'lion'\?$"):
        get_spec("lino")
    with pytest.raises(ValueError, match=r"expected one of \[.*\]$"):  # nothing close: no guess
        OptimizerConfig(lr=1e-3, optimizer="zzzzzz")


def _save_pretrained(folder: Path, config_class: str, **sizes: Any) -> None:
    import transformers  # the test extra has it

    getattr(transformers, config_class)(**sizes).save_pretrained(str(folder))


BERT_SIZES = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


def test_hf_folder_in_the_current_directory_is_a_path_not_a_class(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``hf:bert`` names a folder here (as save_pretrained writes it): config only, no weights."""
    _save_pretrained(tmp_path / "bert", "BertConfig", architectures=["BertForSequenceClassification"], **BERT_SIZES)
    assert not list((tmp_path / "bert").glob("*.safetensors"))
    monkeypatch.chdir(tmp_path)
    for spec in ("hf:bert", "hf:./bert", f"hf:{tmp_path / 'bert'}"):
        document = dump_json(capsys, "--model", spec)
        names = set(group_of(document))
        assert "classifier.weight" in names and "bert.embeddings.word_embeddings.weight" in names, spec  # the saved class
        embeddings = 64 * 32 + 512 * 32 + 2 * 32 + 2 * 32  # word, position, token type, norm
        layer = 4 * (32 * 32 + 32) + 2 * 32 + (32 * 64 + 64) + (64 * 32 + 32) + 2 * 32  # q k v o, norm, mlp, norm
        head = (32 * 32 + 32) + (32 * 2 + 2)  # pooler, 2-label classifier
        assert sum(g["num_elements"] for g in document["groups"]) == embeddings + layer + head, spec
    document = dump_json(capsys, "--model", "hf:bert:AutoModelForMaskedLM")
    assert "cls.predictions.decoder.weight" in group_of(document) or "cls.predictions.transform.dense.weight" in group_of(document)


@pytest.mark.parametrize(
    ("spec", "model_class"),
    [
        ("T5Config", "T5ForConditionalGeneration"),  # AutoModelForSeq2SeqLM
        ("BertConfig", "BertForMaskedLM"),  # an encoder: not its causal head, which wants is_decoder=True
        ("ViTConfig", "ViTForImageClassification"),
        ("LlamaConfig", "LlamaForCausalLM"),
        ("T5Config:AutoModel", "T5Model"),
        ("BertConfig:AutoModelForCausalLM", "BertLMHeadModel"),
        ("ViTConfig:AutoModel", "ViTModel"),
    ],
)
def test_hf_config_picks_the_auto_class_with_a_model_for_it(spec: str, model_class: str) -> None:
    from optzoo.models import build_model

    from transformers.models.auto import modeling_auto as auto
    expected = {
        "AutoModelForCausalLM": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "AutoModelForSeq2SeqLM": auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        "AutoModelForMaskedLM": auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        "AutoModelForImageClassification": auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
        "AutoModel": auto.MODEL_MAPPING_NAMES,
    }
    model_type = {"T5Config": "t5", "BertConfig": "bert", "ViTConfig": "vit", "LlamaConfig": "llama"}[spec.split(":")[0]]
    assert model_class in [table.get(model_type) for table in expected.values()]  # transformers' own tables
    assert type(build_model(f"hf:{spec}")).__name__ == model_class


def test_lint_runs_on_encoder_decoder_and_vision_configs(capsys: pytest.CaptureFixture[str]) -> None:
    for spec in ("hf:T5Config", "hf:BertConfig", "hf:ViTConfig"):
        out = run_ok(capsys, "lint", "--model", spec, "--config", "muon-llm")
        assert out.splitlines()[-1].endswith(("finding", "findings")), (spec, out)


def test_an_auto_class_without_a_model_for_the_config_lists_those_with_one(capsys: pytest.CaptureFixture[str]) -> None:
    line = run_error(capsys, "dump-param-groups", "--model", "hf:ViTConfig:AutoModelForCausalLM")
    assert line == (
        "optzoo: error: `hf:ViTConfig:AutoModelForCausalLM`: AutoModelForCausalLM has no model for this config; "
        "got ViTConfig; expected one of the Auto classes that have one: ['AutoModelForImageClassification', 'AutoModel']"
    )


def test_a_module_in_the_current_directory_is_found(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """The ``optzoo`` script has its own folder first on sys.path, not the current one; ``--model
    mymodels:build`` finds ``./mymodels.py`` as ``python -m`` would, and sys.path is left as found."""
    name = f"optzoo_here_{os.getpid()}_{next(_module_counter)}"
    (tmp_path / f"{name}.py").write_text("from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(4, 3))\n")
    request.addfinalizer(lambda: sys.modules.pop(name, None))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), ".")])
    before = list(sys.path)
    assert group_of(dump_json(capsys, "--model", f"{name}:build")) == {"0.weight": 0, "0.bias": 1}
    assert sys.path == before


def test_explain_shows_the_newton_schulz_kernel_and_why(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 29: per matrix shape of the Muon family, the kernel a step runs: pinned, from the disk
    cache, or the kernels the first step will time (``muon_fp32_matmul_prec`` bounds them)."""
    config = tmp_path / "muon.toml"
    config.write_text('[config]\noptimizer = "muon"\nlr = 0.02\nmuon_fp32_matmul_prec = "highest"\n')
    monkeypatch.delenv("OPTZOO_NS_VARIANT")
    code, out, _ = run(capsys, "dump-param-groups", "--model", "gpt", "--config", str(config), "--explain", "--format", "json")
    assert code == 0
    kernels = json.loads(out)["newton_schulz"]
    # The built-in GPT at hidden 128, 2 layers: its MLP matrices are 512x128 and 128x512, two of each.
    assert {row["matrices"] for row in kernels} >= {"512x128", "128x512"}
    assert all(row["Newton-Schulz kernel"] == "probed at the first step: the fastest of 4 on CPU (standard/ieee, gram/ieee; "
               "stacked or per matrix)" for row in kernels)  # fmt: skip
    cache = tmp_path / "ns.json"
    monkeypatch.setenv("OPTZOO_NS_CACHE", str(cache))
    from optzoo.optimizers.newton_schulz_probe import machine_key

    cache.write_text(json.dumps({machine_key(torch.device("cpu")): {"float32 128x512 batch<=2 highest steps=5": {"kernel": "gram/ieee"}}}))
    code, out, _ = run(capsys, "dump-param-groups", "--model", "gpt", "--config", str(config), "--explain", "--format", "json")
    by_shape = {row["matrices"]: row["Newton-Schulz kernel"] for row in json.loads(out)["newton_schulz"]}
    assert by_shape["512x128"] == by_shape["128x512"] == "gram/ieee (OPTZOO_NS_CACHE, on CPU)"
    monkeypatch.setenv("OPTZOO_NS_VARIANT", "standard/ieee/per-matrix")
    code, out, _ = run(capsys, "dump-param-groups", "--model", "gpt", "--config", str(config), "--explain")
    assert code == 0 and re.search(r"512x128\s+2\s+highest\s+standard/ieee/per-matrix \(pinned\)", out)
