"""Issue 24 ("Nothing lost under faults"): config files, schedules and resolution that used to
accept input that trains on something nobody meant.

Expected values are typed here from Megatron-Core's documented formulas (``min_lr + coeff *
(max_lr - min_lr)``), from the YAML specs (1.1: ``0755`` is octal 493, ``1:30`` base 60 is 90,
``yes`` is True; 1.2 core: ``0o17`` is 15) and from the exact house messages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from optzoo import OptimizerConfig, OptimizerParamScheduler, ParamKey, get_optimizer
from optzoo.cli import main
from optzoo.config_file import load_config_file, parse_recipe
from tests.conftest import tiny_gpt

BASE: dict[str, Any] = dict(
    init_lr=0.0, max_lr=0.1, min_lr=0.01, lr_warmup_steps=0, lr_decay_steps=10, lr_decay_style="cosine",
    start_wd=0.0, end_wd=0.1, wd_incr_steps=10, wd_incr_style="linear",
)  # fmt: skip


def sgd(*groups: dict[str, Any]) -> torch.optim.SGD:
    """A plain torch optimizer, one fresh named param per group."""
    return torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(2))], "param_names": [f"p{i}"], **g} for i, g in enumerate(groups)], lr=0.5
    )


# ---- item 4: a group's own bounds mixed with the scheduler's fallbacks --------------------------


def test_a_group_max_lr_below_the_schedulers_min_lr_is_refused_naming_both_sources() -> None:
    # max_lr=1e-4 by override, min_lr unset: the scheduler's min_lr=1e-3 would anneal the group up to 10x its peak.
    optimizer = get_optimizer(OptimizerConfig(lr=1e-3, standard_overrides=False), tiny_gpt(), {ParamKey(name="output_layer.weight"): {"max_lr": 1e-4}})  # the rule alone
    with pytest.raises(ValueError, match=re.escape(
        "`OptimizerParamScheduler.min_lr`: must not exceed max_lr (param group #1 (output_layer.weight)): the decay would "
        "raise the lr to min_lr; got min_lr=0.001 (the scheduler's min_lr), max_lr=0.0001 (the group's max_lr); "
        "expected min_lr <= max_lr: set both in the group's override, or change the scheduler's"
    )):  # fmt: skip
        OptimizerParamScheduler(optimizer, **{**BASE, "max_lr": 1e-3, "min_lr": 1e-3})


def test_a_group_min_lr_above_the_schedulers_max_lr_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "got min_lr=0.5 (the group's min_lr), max_lr=0.1 (the scheduler's max_lr)"
    )):  # fmt: skip
        OptimizerParamScheduler(sgd({}, {"min_lr": 0.5}), **BASE)


def test_a_group_start_wd_above_the_schedulers_end_wd_is_refused_for_a_ramp() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "`OptimizerParamScheduler.start_wd`: must not exceed end_wd with wd_incr_style='linear' (param group #0 (p0)): "
        "the weight decay would fall; got start_wd=0.3 (the group's start_wd), end_wd=0.1 (the scheduler's end_wd)"
    )):  # fmt: skip
        OptimizerParamScheduler(sgd({"start_wd": 0.3}), **BASE)


def test_a_group_max_lr_below_init_lr_is_refused_only_with_a_warmup() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "`OptimizerParamScheduler.init_lr`: must not exceed max_lr (param group #0 (p0)): the warmup would lower the lr; "
        "got init_lr=0.05 (the scheduler's init_lr), max_lr=0.02 (the group's max_lr)"
    )):  # fmt: skip
        OptimizerParamScheduler(sgd({"max_lr": 0.02, "min_lr": 0.0}), **{**BASE, "init_lr": 0.05, "lr_warmup_steps": 2})
    OptimizerParamScheduler(sgd({"max_lr": 0.02, "min_lr": 0.0}), **{**BASE, "init_lr": 0.05})  # no warmup: init_lr unused


def test_a_group_added_later_is_checked_before_any_group_changes() -> None:
    optimizer = sgd({})
    scheduler = OptimizerParamScheduler(optimizer, **BASE)
    scheduler.step(2)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "param_names": ["late"], "min_lr": 1.0})
    before = [dict(g, params=None) for g in optimizer.param_groups]
    with pytest.raises(ValueError, match=re.escape("(param group #1 (late))")):
        scheduler.step(1)
    assert scheduler.num_steps == 2
    assert [dict(g, params=None) for g in optimizer.param_groups] == before


def test_consistent_mixed_bounds_follow_megatrons_cosine() -> None:
    # Group min_lr 0.02 under the scheduler's max_lr 0.1: at step 5 of 10, coeff = (1 + cos(pi/2)) / 2 = 0.5.
    optimizer = sgd({"min_lr": 0.02})
    scheduler = OptimizerParamScheduler(optimizer, **BASE)
    scheduler.step(5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.02 + 0.5 * (0.1 - 0.02), rel=1e-15)


# ---- item 16: a WSD anneal longer than the decay window ------------------------------------------


def test_a_wsd_anneal_longer_than_the_decay_window_is_refused_naming_both() -> None:
    wsd = {**BASE, "lr_decay_style": "WSD", "lr_wsd_decay_style": "linear", "lr_warmup_steps": 2}
    with pytest.raises(ValueError, match=re.escape(
        "`OptimizerParamScheduler.wsd_decay_steps`: the anneal must fit in the decay window after the warmup; got "
        "wsd_decay_steps=9, lr_decay_steps=10, lr_warmup_steps=2; expected wsd_decay_steps <= lr_decay_steps - "
        "lr_warmup_steps = 8"
    )):  # fmt: skip
        OptimizerParamScheduler(sgd({}), **wsd, wsd_decay_steps=9)
    with pytest.raises(ValueError, match=r"wsd_decay_steps=11, lr_decay_steps=10"):
        OptimizerParamScheduler(sgd({}), **wsd, wsd_decay_steps=11)
    optimizer = sgd({})
    scheduler = OptimizerParamScheduler(optimizer, **wsd, wsd_decay_steps=8)  # the whole window: accepted
    scheduler.step(6)  # anneal from step 2: ratio (6 - 2) / 8, linear coeff 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 + 0.5 * (0.1 - 0.01), rel=1e-15)


# ---- item 18: weight_decay x wd_mult overflowing ---------------------------------------------------


def test_weight_decay_times_wd_mult_overflowing_is_refused_at_resolution() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "`param group #0 (rules #0 name='*')`: `weight_decay` times `wd_mult` overflows to inf; got weight_decay=1e+308, "
        "wd_mult=10.0; expected a product below float max (1.8e308)"
    )):  # fmt: skip
        get_optimizer(OptimizerConfig(lr=1e-3, weight_decay=1e308), tiny_gpt(), {ParamKey(name="*"): {"wd_mult": 10.0}})


def test_a_scheduler_weight_decay_times_wd_mult_overflowing_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape(
        "`OptimizerParamScheduler.weight_decay`: overflows: the scheduler's end_wd times the group's wd_mult is inf "
        "(param group #0 (p0)); got 1e+300 * wd_mult=10000000000.0; expected a product below float max (1.8e308)"
    )):  # fmt: skip
        OptimizerParamScheduler(sgd({"wd_mult": 1e10}), **{**BASE, "end_wd": 1e300})


# ---- item 14: YAML duplicates and YAML 1.1 scalars ---------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_yaml_duplicate_key_is_refused_naming_key_file_and_lines(tmp_path: Path) -> None:
    path = write(tmp_path, "dup.yaml", "config:\n  lr: 1e-3\n  weight_decay: 0.1\n  lr: 5.0\n")
    with pytest.raises(ValueError, match=re.escape(
        f"`{path}`: line 4: duplicate key 'lr' (first at line 2); got the key twice in one mapping; expected each key "
        "once (PyYAML would keep the last value)"
    )):  # fmt: skip
        load_config_file(path)


def test_a_toml_duplicate_key_is_refused_too(tmp_path: Path) -> None:  # already so before issue 24: pinned
    path = write(tmp_path, "dup.toml", "[config]\nlr = 1e-3\nlr = 5.0\n")
    with pytest.raises(ValueError, match=re.escape(f"`{path}`: invalid TOML; got Cannot overwrite a value (at line 3, column 9)")):
        load_config_file(path)


@pytest.mark.parametrize(
    ("text", "old", "new"),
    [("0755", "493", "755"), ("1:30", "90", "'1:30'"), ("1_000", "1000", "'1_000'"), ("2024-01-01", "datetime.date(2024, 1, 1)", "'2024-01-01'")],
)
def test_a_yaml_11_number_is_refused_naming_both_readings(tmp_path: Path, text: str, old: str, new: str) -> None:
    path = write(tmp_path, "odd.yaml", f"config:\n  lr: 1e-3\n  loss_scale_window: {text}\n")
    with pytest.raises(ValueError, match=re.escape(
        f"`{path}`: line 3: ambiguous plain scalar {text!r}; got {old} in YAML 1.1 (PyYAML's default), {new} in YAML 1.2; "
        "expected quotes for a string, a decimal number without leading zeros (or 0o/0x), or true/false"
    )):  # fmt: skip
        load_config_file(path)


def test_a_yaml_11_bool_is_refused_and_12_values_are_read_as_12(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=re.escape("line 2: ambiguous plain scalar 'yes'; got True in YAML 1.1")):
        parse_recipe("config:\n  bf16: yes\n", "yaml")
    config, _ = parse_recipe("config:\n  lr: 1e-3\n  loss_scale_window: 0o17\n  hysteresis: 0x10\n  bf16: true\n", "yaml")
    assert (config.loss_scale_window, config.hysteresis, config.bf16) == (15, 16, True)
    assert parse_recipe("overrides:\n  - name: 'on'\n    set: {wd_mult: 0.0}\n", "yaml")[1] is not None  # quoted: a string


# ---- item 15: deep nesting -------------------------------------------------------------------------


@pytest.mark.parametrize("levels", [40, 100_000])
def test_a_deeply_nested_config_is_one_error_line_naming_file_and_limit(tmp_path: Path, levels: int, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "deep.toml", "[config]\nlr = 1e-3\n[[overrides]]\nname = " + "[" * levels + "]" * levels + "\n")
    assert main(["dump-param-groups", "--model", "gpt", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"optzoo: error: `{re.escape(str(path))}`: nested too deeply; got .*; expected at most 32 levels of tables and "
        r"lists \(a recipe needs 4\)\n",
        err,
    ), err


# ---- old checks: dump-param-groups and get_optimizer agree; hf: JSON errors name the file -----------


def test_dump_param_groups_refuses_a_config_logger_dir_that_get_optimizer_cannot_create(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = write(tmp_path, "afile", "")
    path = write(tmp_path, "log.toml", f'[config]\nlr = 1e-3\nconfig_logger_dir = "{blocker}/logs"\n')
    assert main(["dump-param-groups", "--model", "gpt", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"optzoo: error: `OptimizerConfig.config_logger_dir`: cannot be created: '{blocker}' is not a directory; got "
        f"'{blocker}/logs'; expected a directory path that can be created (get_optimizer writes optimizer_config.json "
        "there), or ''\n"
    )


def test_an_invalid_hf_json_config_names_the_file_and_position(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "config.json", '{"model_type": "llama",\n  oops}')
    assert main(["dump-param-groups", "--model", f"hf:{path}"]) == 2
    assert capsys.readouterr().err == (
        f"optzoo: error: `hf:{path}`: invalid JSON in '{path}'; got Expecting property name enclosed in double quotes "
        "at line 2 column 3 (char 26); expected a Hugging Face config.json\n"
    )
