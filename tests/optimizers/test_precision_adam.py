"""PrecisionAwareAdam and its bf16 + int16 remainder encoding against independent references.

The references are torch.optim.AdamW/Adam over master copies and a float64 rounding on the bf16
grid (tests/optimizers/reference/precision_adam.py). Each of the optimizer's three paths is
compared with the torch kernel it runs or transcribes: the plain per-tensor path with torch's
single-tensor Adam (``foreach=False``), the fused and foreach paths with ``fused=True`` and
``foreach=True``. Those comparisons are exact: the same float32 operations in the same order, and
every rounding (fp32 to bf16 or fp16, nearest-even or half-away) is deterministic. Across paths
(fused against plain) the results agree within a stated tolerance only.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from optzoo.optimizers.bf16_remainder import join_bf16_remainder, round_half_up_to_bf16, split_fp32
from optzoo.optimizers import precision_adam
from optzoo.optimizers.precision_adam import PrecisionAwareAdam
from tests.optimizers.reference.precision_adam import (
    Kernel,
    MasterAdam,
    round_half_away_to_bf16,
    round_nearest_even_to_bf16,
)

SHAPES = [(5, 7), (33, 65), (7,)]
HYPER: dict[str, Any] = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
PATHS: dict[str, tuple[dict[str, Any], Kernel]] = {
    "plain": ({"fused": False, "foreach": False}, "single"),
    "fused": ({"fused": True}, "fused"),
    "foreach": ({"foreach": True}, "foreach"),
}
"""Each path of PrecisionAwareAdam (its constructor options) and the torch.optim kernel it equals."""
path_ids = pytest.mark.parametrize("path", PATHS)


def _int32(*patterns: int) -> torch.Tensor:
    """32-bit patterns written as unsigned hex, as an int32 tensor."""
    return torch.tensor([p - (1 << 32) if p >= 1 << 31 else p for p in patterns], dtype=torch.int32)


def _bits16(x: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in x.view(torch.int16).tolist()]


def _random_finite_fp32(count: int, seed: int) -> torch.Tensor:
    """Uniform random 32-bit patterns read as fp32, non-finite ones dropped (~0.4%)."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 31), 1 << 31, (count,), generator=generator, dtype=torch.int64).to(torch.int32)
    values = bits.view(torch.float32)
    return values[torch.isfinite(values)]


def _params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(dtype)) for shape in SHAPES]


def _grads(params: list[torch.nn.Parameter], generator: torch.Generator, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    return [torch.randn(p.shape, generator=generator).to(dtype or p.dtype) for p in params]


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    assert actual.dtype == expected.dtype, (msg, actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True, msg=msg or None)


# --- the bf16 + int16 remainder encoding --------------------------------------------------------


def test_split_then_join_restores_a_million_random_finite_fp32_bit_patterns() -> None:
    values = _random_finite_fp32(1 << 20, seed=0)
    high, remainder = split_fp32(values)
    assert high.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_bf16_remainder(high, remainder).view(torch.int32), values.view(torch.int32))
    # the remainder is the low 16 bits, read as signed
    low = values.view(torch.int32) & 0xFFFF
    assert torch.equal(remainder.to(torch.int32), torch.where(low >= 0x8000, low - 0x10000, low))


@pytest.mark.parametrize(
    ("pattern", "high", "remainder", "case"),
    [
        (0x00000000, 0x0000, 0, "+0"),
        (0x80000000, 0x8000, 0, "-0"),
        (0x3F808000, 0x3F81, -0x8000, "tie, even high half: up"),
        (0x3F818000, 0x3F82, -0x8000, "tie, odd high half: up"),
        (0x3F807FFF, 0x3F80, 0x7FFF, "just below a tie: down"),
        (0x3F80FFFF, 0x3F81, -1, "low bits all ones: up"),
        (0xBF808000, 0xBF81, -0x8000, "negative tie: away from zero"),
        (0xBF807FFF, 0xBF80, 0x7FFF, "negative, below a tie: toward zero"),
        (0xBF80FFFF, 0xBF81, -1, "negative, low bits all ones: away from zero"),
        (0x00000001, 0x0000, 1, "smallest subnormal: high half +0"),
        (0x00008000, 0x0001, -0x8000, "subnormal tie: smallest bf16 subnormal"),
        (0x80008001, 0x8001, -0x7FFF, "negative subnormal"),
        (0x007FFFFF, 0x0080, -1, "largest subnormal: smallest bf16 normal"),
        (0x7F7F7FFF, 0x7F7F, 0x7FFF, "largest fp32 that keeps a finite high half: bf16 max"),
        (0x7F7FFFFF, 0x7F80, -1, "largest finite fp32: high half +inf, master still finite"),
        (0xFF7FFFFF, 0xFF80, -1, "most negative finite fp32: high half -inf"),
        (0x7F800000, 0x7F80, 0, "+inf"),
        (0xFF800000, 0xFF80, 0, "-inf"),
        (0x7FC00000, 0x7FC0, 0, "canonical NaN stays NaN"),
        (0xFFC00000, 0xFFC0, 0, "x86 default NaN stays NaN"),
        (0x7FFF8000, 0x8000, -0x8000, "NaN, high half 0x7FFF: wraps to -0 (as TE's int16 ++)"),
        (0xFFFFFFFF, 0x0000, -1, "NaN, high half 0xFFFF: wraps to +0"),
    ],
)
def test_split_and_join_on_hand_picked_bit_patterns(pattern: int, high: int, remainder: int, case: str) -> None:
    bits = _int32(pattern)
    got_high, got_remainder = split_fp32(bits.view(torch.float32))
    assert _bits16(got_high) == [high], case
    assert got_remainder.tolist() == [remainder], case
    # exact round trip, NaN payloads included (the wrapped NaNs rely on two's complement int32 wrap)
    assert torch.equal(join_bf16_remainder(got_high, got_remainder).view(torch.int32), bits), case


def test_round_half_up_equals_the_float64_grid_reference() -> None:
    values = _random_finite_fp32(1 << 20, seed=1)
    assert torch.equal(round_half_up_to_bf16(values).view(torch.int16), round_half_away_to_bf16(values).view(torch.int16))


def test_round_half_up_differs_from_torch_nearest_even_exactly_on_ties_with_an_even_high_half() -> None:
    """The relationship: let h = high 16 bits, l = low 16 bits of a finite fp32 x. Both roundings
    truncate when l < 0x8000 and round away from zero when l > 0x8000. At l == 0x8000 half-up
    rounds away from zero; nearest-even does too when h is odd (h + 1 is even) and truncates when
    h is even. So they differ exactly when l == 0x8000 and h is even, and there the half-up bits
    are nearest-even's plus one (one bf16 ulp further from zero: IEEE is sign-magnitude)."""
    generator = torch.Generator().manual_seed(2)
    random = _random_finite_fp32(1 << 20, seed=3)
    tie_highs = torch.randint(0, 1 << 16, (1 << 16,), generator=generator, dtype=torch.int32)
    ties = ((tie_highs << 16) | 0x8000).view(torch.float32)
    values = torch.cat([random, ties[torch.isfinite(ties)], _int32(0x7F7FFFFF, 0x7F7F8000, 0x7F7E8000).view(torch.float32)])

    half_up = round_half_up_to_bf16(values).view(torch.int16).to(torch.int32)
    nearest_even = round_nearest_even_to_bf16(values).view(torch.int16).to(torch.int32)
    bits = values.view(torch.int32)
    even_tie = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0)
    assert even_tie.sum() > 30_000  # half of the constructed ties
    assert torch.equal(half_up[even_tie], nearest_even[even_tie] + 1)
    assert torch.equal(half_up[~even_tie], nearest_even[~even_tie])
    # overflow agrees: the largest finite fp32 and the odd tie past bf16 max go to +inf both ways
    assert torch.isinf(round_half_up_to_bf16(_int32(0x7F7FFFFF, 0x7F7F8000).view(torch.float32))).all()


def test_join_and_split_reject_wrong_dtypes_and_shapes() -> None:
    with pytest.raises(TypeError, match=r"`master`: split_fp32 cuts float32 bit patterns; got torch.float64; expected torch.float32"):
        split_fp32(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"`high, remainder`: .*; got \(torch.float32, torch.int16\); expected \(torch.bfloat16, torch.int16\)"):
        join_bf16_remainder(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"`remainder`: shape differs from the high half's; got \(2,\); expected \(3,\)"):
        join_bf16_remainder(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int16))



def test_join_writes_into_out_and_names_an_out_that_does_not_fit() -> None:
    values = _random_finite_fp32(1 << 12, seed=3)
    high, remainder = split_fp32(values)
    out = torch.empty_like(values, dtype=torch.int32)
    joined = join_bf16_remainder(high, remainder, out=out)
    assert joined.data_ptr() == out.data_ptr() and torch.equal(joined.view(torch.int32), values.view(torch.int32))
    with pytest.raises(TypeError, match=r"^`out`: must be an int32 tensor of the halves' shape; got torch.float32 of shape"):
        join_bf16_remainder(high, remainder, out=torch.empty_like(values))
    with pytest.raises(ValueError, match=r"^`out`: .*; got torch.int32 of shape \(3,\); expected torch.int32 of shape"):
        join_bf16_remainder(high, remainder, out=torch.empty(3, dtype=torch.int32))

# --- the optimizer against torch.optim ----------------------------------------------------------


@path_ids
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_all_fp32_equals_torch_adam_with_the_same_kernel_bitwise(decoupled: bool, path: str) -> None:
    options, kernel = PATHS[path]
    params = _params(torch.float32)
    reference = MasterAdam(params, decoupled=decoupled, kernel=kernel, **HYPER)
    ours = PrecisionAwareAdam(params, decoupled_weight_decay=decoupled, **options, **HYPER)
    generator = torch.Generator().manual_seed(4)
    for _ in range(20):
        grads = _grads(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
    # The same float32 operations in the same order as the torch kernel: identical bits.
    for i, (p, expected) in enumerate(zip(params, reference.model())):
        _assert_bitwise(p.detach(), expected, f"param {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_bitwise(ours.state[p][key], reference.moment(i, key), f"{key} {i}")
        assert ours.state[p]["step"].item() == 20 and "master_param" not in ours.state[p]


@pytest.mark.parametrize("path", ["plain", "fused"])  # foreach: fp32, remainder and moment tests
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
def test_half_params_with_fp32_masters_follow_torch_on_the_masters(model_dtype: torch.dtype, decoupled: bool, path: str) -> None:
    options, kernel = PATHS[path]
    params = _params(model_dtype)
    reference = MasterAdam(params, decoupled=decoupled, kernel=kernel, **HYPER)  # model = master.to(dtype): nearest even
    ours = PrecisionAwareAdam(params, decoupled_weight_decay=decoupled, master_weights=True, **options, **HYPER)
    generator = torch.Generator().manual_seed(5)
    for step in range(100):
        grads = _grads(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
        for i, (p, expected) in enumerate(zip(params, reference.model())):
            master = ours.state[p]["master_param"]
            assert master.dtype == torch.float32 and p.dtype == model_dtype
            _assert_bitwise(p.detach(), master.to(model_dtype), f"step {step}: param {i} is its master, rounded")
            _assert_bitwise(p.detach(), expected, f"step {step}: param {i}")
    for i, p in enumerate(params):
        _assert_bitwise(ours.state[p]["master_param"], reference.masters[i].detach(), f"master {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_bitwise(ours.state[p][key], reference.moment(i, key), f"{key} {i}")


def _step_remainders_beside(
    ours: PrecisionAwareAdam, reference: MasterAdam, params: list[torch.nn.Parameter], generator: torch.Generator, steps: int
) -> None:
    """Step ``ours`` (with remainders) and ``reference`` on the same gradients; the params must stay
    bitwise equal at every step, and the joined masters and the moments at the end."""
    for step in range(steps):
        grads = _grads(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
        for i, (p, expected) in enumerate(zip(params, reference.model())):
            _assert_bitwise(p.detach(), expected, f"step {step}: param {i}")
    for i, p in enumerate(params):
        state = ours.state[p]
        _assert_bitwise(join_bf16_remainder(p.detach(), state["master_param"]), reference.masters[i].detach(), f"master {i}")
        for key in ("exp_avg", "exp_avg_sq"):
            _assert_bitwise(state[key], reference.moment(i, key), f"{key} {i}")


@path_ids
def test_remainders_are_bit_identical_to_an_fp32_master_rounded_half_away(path: str) -> None:
    options, kernel = PATHS[path]
    params = _params(torch.bfloat16)
    reference = MasterAdam(params, to_model=round_half_away_to_bf16, kernel=kernel, **HYPER)
    ours = PrecisionAwareAdam(params, master_weights=True, store_param_remainders=True, **options, **HYPER)
    _step_remainders_beside(ours, reference, params, torch.Generator().manual_seed(6), steps=200)
    for p in params:
        state = ours.state[p]
        # master state: 2 bytes per parameter (int16) instead of an fp32 copy's 4
        assert state["master_param"].dtype == torch.int16
        assert state["master_param"].element_size() * state["master_param"].numel() == 2 * p.numel()


def test_remainders_and_nearest_even_masters_share_the_master_and_differ_only_on_even_ties() -> None:
    """Same grads, two runs: the fp32 masters agree bit for bit (the encoding is lossless), and the
    bf16 params agree except on even ties, where the remainder run is exactly one bf16 ulp further
    from zero (the relation pinned above). So the bf16 params stay within one bf16 ulp."""
    remainder_params, nearest_params = _params(torch.bfloat16), _params(torch.bfloat16)
    remainder_opt = PrecisionAwareAdam(remainder_params, master_weights=True, store_param_remainders=True, **HYPER)
    nearest_opt = PrecisionAwareAdam(nearest_params, master_weights=True, **HYPER)
    generator = torch.Generator().manual_seed(7)
    ties = 0
    for _ in range(200):
        for p, q, g in zip(remainder_params, nearest_params, _grads(remainder_params, generator)):
            p.grad, q.grad = g, g.clone()
        remainder_opt.step()
        nearest_opt.step()
        for p, q in zip(remainder_params, nearest_params):
            master = nearest_opt.state[q]["master_param"]
            _assert_bitwise(join_bf16_remainder(p.detach(), remainder_opt.state[p]["master_param"]), master)
            bits = master.view(torch.int32)
            even_tie = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) % 2 == 0)
            ties += int(even_tie.sum())
            up, even = p.detach().view(torch.int16).to(torch.int32), q.detach().view(torch.int16).to(torch.int32)
            assert torch.equal(up, even + even_tie.to(torch.int32))
    # The run does reach the case where the two roundings differ (deterministic: seeded CPU run).
    assert ties > 0


@pytest.mark.parametrize(
    ("dtype", "config"),
    [(torch.float32, {}), (torch.bfloat16, {"master_weights": True, "store_param_remainders": True})],
    ids=["fp32", "bf16-remainders"],
)
def test_fused_and_plain_paths_agree_to_fp32_rounding(dtype: torch.dtype, config: dict[str, Any]) -> None:
    """Each path is bitwise its torch kernel (above); across paths only rounding differs: torch's
    fused kernel associates differently (``v * beta2 + g * g * (1 - beta2)``, ``step_size * m /
    denom``) and rounds in other places. ``exp_avg_sq`` is a sum of non-negative terms, so each
    step's gap is a couple of fp32 roundings relative to it, and older gaps decay by ``beta2``:
    we allow 2**-23 / (1 - beta2) relative (2 ulps of 2**-24 per step, summed over the decay).
    Masters (and ``exp_avg``) carry that through ``sqrt`` plus one rounding per step: we allow
    8 fp32 ulps (2**-20) relative plus 1e-6 absolute near zero, four orders below one step's
    update (lr = 1e-2), so an error in the update rule would fail. bf16 params add one bf16
    rounding on top: one bf16 spacing, 2**-7 relative. Measured here (CPU, torch 2.14): masters
    2.4e-7 apart at most, ``exp_avg_sq`` 2.8e-7 relative, ``exp_avg`` and bf16 params equal."""
    fused_params, plain_params = _params(dtype), _params(dtype)
    fused = PrecisionAwareAdam(fused_params, **config, **PATHS["fused"][0], **HYPER)
    plain = PrecisionAwareAdam(plain_params, **config, **PATHS["plain"][0], **HYPER)
    generator = torch.Generator().manual_seed(15)
    for _ in range(200):
        for p, q, g in zip(fused_params, plain_params, _grads(fused_params, generator)):
            p.grad, q.grad = g, g.clone()
        fused.step()
        plain.step()
    exp_avg_sq_rtol = 2**-23 / (1 - HYPER["betas"][1])
    for p, q in zip(fused_params, plain_params):
        torch.testing.assert_close(fused.state[p]["exp_avg_sq"], plain.state[q]["exp_avg_sq"], atol=0, rtol=exp_avg_sq_rtol)
        torch.testing.assert_close(fused.state[p]["exp_avg"], plain.state[q]["exp_avg"], atol=1e-6, rtol=2**-20)
        if "store_param_remainders" in config:
            masters = [join_bf16_remainder(r.detach(), opt.state[r]["master_param"]) for r, opt in ((p, fused), (q, plain))]
            torch.testing.assert_close(masters[0], masters[1], atol=1e-6, rtol=2**-20)
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=2**-7)
        else:
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=2**-20)
        assert fused.state[p]["step"].item() == plain.state[q]["step"].item() == 200


# --- low-precision moments ----------------------------------------------------------------------


@path_ids
@pytest.mark.parametrize(
    ("exp_avg_dtype", "exp_avg_sq_dtype", "state_bytes"),
    [
        (torch.float32, torch.float32, 8),
        (torch.bfloat16, torch.bfloat16, 4),
        (torch.float16, torch.float16, 4),
        (torch.bfloat16, torch.float32, 6),
    ],
)
def test_moments_are_stored_in_their_dtype_and_equal_torch_with_rounded_moments(
    exp_avg_dtype: torch.dtype, exp_avg_sq_dtype: torch.dtype, state_bytes: int, path: str
) -> None:
    options, kernel = PATHS[path]
    params = _params(torch.float32)
    dtypes: dict[str, Any] = {"exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}
    reference = MasterAdam(params, kernel=kernel, **dtypes, **HYPER)
    ours = PrecisionAwareAdam(params, **options, **dtypes, **HYPER)
    generator = torch.Generator().manual_seed(8)
    for _ in range(50):
        grads = _grads(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
    for i, (p, expected) in enumerate(zip(params, reference.model())):
        _assert_bitwise(p.detach(), expected, f"param {i}")
        state = ours.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == dtypes[f"{key}_dtype"]
            _assert_bitwise(state[key], reference.moment(i, key), f"{key} {i}")
        moment_bytes = sum(state[k].element_size() * state[k].numel() for k in ("exp_avg", "exp_avg_sq"))
        assert moment_bytes == state_bytes * p.numel()


@path_ids
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_moments_converge_on_a_quadratic(dtype: torch.dtype, path: str) -> None:
    weight = torch.nn.Parameter(torch.zeros(5, 7))
    target = torch.randn(5, 7)
    opt = PrecisionAwareAdam([weight], lr=0.05, exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype, **PATHS[path][0])
    start = 0.5 * target.square().sum().item()
    for _ in range(200):
        opt.zero_grad()
        loss = 0.5 * (weight - target).square().sum()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    assert 0.5 * (weight - target).square().sum().item() < 0.01 * start
    assert opt.state[weight]["exp_avg"].dtype == dtype == opt.state[weight]["exp_avg_sq"].dtype


# --- kernel choice ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fused", "foreach", "chosen"),
    [
        (None, None, "fused"),
        (None, False, "fused"),
        (True, None, "fused"),
        (True, False, "fused"),
        (None, True, "foreach"),
        (False, None, "foreach"),
        (False, True, "foreach"),
        (False, False, "plain"),
    ],
)
def test_kernel_choice_is_fused_then_foreach_then_plain(fused: bool | None, foreach: bool | None, chosen: str) -> None:
    opt = PrecisionAwareAdam(_params(torch.bfloat16), master_weights=True, fused=fused, foreach=foreach)
    group = opt.param_groups[0]
    assert (group["fused"], group["foreach"]) == (chosen == "fused", chosen == "foreach")


def test_without_a_fused_kernel_the_default_is_foreach() -> None:
    # torch has no fused kernel on the meta device (nor in _get_fused_kernels_supported_devices)
    on_meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    default = PrecisionAwareAdam(on_meta).param_groups[0]
    assert (default["fused"], default["foreach"]) == (False, True)
    plain = PrecisionAwareAdam(on_meta, foreach=False).param_groups[0]
    assert (plain["fused"], plain["foreach"]) == (False, False)
    with pytest.raises(ValueError, match=r"param group #0: `fused`: torch has no fused Adam kernel for these params; got devices \['meta'\]; expected devices in"):
        PrecisionAwareAdam(on_meta, fused=True)


def test_kernels_are_chosen_per_group_and_step_is_placed_for_the_kernel() -> None:
    fused_param, plain_param = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    groups: list[dict[str, Any]] = [{"params": [fused_param]}, {"params": [plain_param], "fused": False, "foreach": False}]
    opt = PrecisionAwareAdam(groups)
    assert [(g["fused"], g["foreach"]) for g in opt.param_groups] == [(True, False), (False, False)]
    fused_param.grad, plain_param.grad = torch.ones(3), torch.ones(3)
    opt.step()
    for param in (fused_param, plain_param):  # a float32 scalar, as torch keeps it (on the param's device when fused)
        step = opt.state[param]["step"]
        assert step.dtype == torch.float32 and step.shape == () and step.item() == 1 and step.device == param.device


# --- other dtypes and gradient sources ----------------------------------------------------------


@path_ids
def test_float64_params_are_computed_in_float64(path: str) -> None:
    options, kernel = PATHS[path]
    params = _params(torch.float64)
    reference = MasterAdam(
        params, master_dtype=torch.float64, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32, kernel=kernel, **HYPER
    )
    ours = PrecisionAwareAdam(params, **options, **HYPER)  # moments stored in the default float32
    generator = torch.Generator().manual_seed(9)
    for _ in range(20):
        grads = _grads(params, generator)
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
    for i, (p, expected) in enumerate(zip(params, reference.model())):
        _assert_bitwise(p.detach(), expected, f"param {i}")
        assert ours.state[p]["exp_avg"].dtype == torch.float32


@path_ids
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_master_of_same_dtype_params_changes_nothing_but_is_stored(dtype: torch.dtype, path: str) -> None:
    """A master in the params' own 16-bit dtype rounds each step exactly as the param does: the run
    equals one without master weights, bit for bit, and the master equals the param."""
    with_master, without = _params(dtype), _params(dtype)
    ours = PrecisionAwareAdam(with_master, master_weights=True, master_weight_dtype=dtype, **PATHS[path][0], **HYPER)
    plain = PrecisionAwareAdam(without, **PATHS[path][0], **HYPER)
    generator = torch.Generator().manual_seed(10)
    for _ in range(10):
        for p, q, g in zip(with_master, without, _grads(with_master, generator)):
            p.grad, q.grad = g, g.clone()
        ours.step()
        plain.step()
    for p, q in zip(with_master, without):
        _assert_bitwise(p.detach(), q.detach())
        _assert_bitwise(ours.state[p]["master_param"], p.detach())


def test_a_master_that_cannot_hold_the_params_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"param group #0, param #1: `master_weight_dtype` torch.float16 cannot hold every value of the param \(masters are stored unscaled\); got a torch.bfloat16 param; expected a param dtype in \[torch.float16\]"):
        PrecisionAwareAdam([torch.ones(2, dtype=torch.float16), torch.ones(2, dtype=torch.bfloat16)], master_weights=True, master_weight_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"`master_weight_dtype` torch.float32 cannot hold every value of the param .*; got a torch.float64 param; expected a param dtype in \[torch.float32, torch.bfloat16, torch.float16\]"):
        PrecisionAwareAdam([torch.ones(2, dtype=torch.float64)], master_weights=True)


@path_ids
def test_decoupled_grad_is_read_instead_of_grad_and_cleared_by_zero_grad(path: str) -> None:
    options, kernel = PATHS[path]
    params = _params(torch.bfloat16)
    reference = MasterAdam(params, kernel=kernel, **HYPER)
    ours = PrecisionAwareAdam(params, master_weights=True, use_decoupled_grad=True, **options, **HYPER)
    generator = torch.Generator().manual_seed(11)
    for _ in range(10):
        grads = _grads(params, generator, dtype=torch.float32)  # fp32 grads for bf16 params
        for p, g in zip(params, grads):
            p.decoupled_grad = g  # type: ignore[attr-defined]
            p.grad = torch.full_like(p, 1000.0)  # ignored
        ours.step()
        reference.step(grads)
    for i, (p, expected) in enumerate(zip(params, reference.model())):
        _assert_bitwise(p.detach(), expected, f"param {i}")
    ours.zero_grad(set_to_none=False)
    assert all(torch.equal(p.decoupled_grad, torch.zeros(p.shape)) for p in params)  # type: ignore[attr-defined]
    ours.zero_grad()
    assert all(p.decoupled_grad is None and p.grad is None for p in params)  # type: ignore[attr-defined]


def test_params_without_a_gradient_are_skipped() -> None:
    with_grad, without = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = PrecisionAwareAdam([with_grad, without], master_weights=True)
    with_grad.grad = torch.ones(3)
    opt.step()
    assert not torch.equal(with_grad, torch.ones(3)) and torch.equal(without, torch.ones(3))
    assert without not in opt.state


# --- state dict ---------------------------------------------------------------------------------

CONFIGS: dict[str, tuple[torch.dtype, dict[str, Any]]] = {
    "fp32": (torch.float32, {}),
    "bf16-remainders-bf16-moments": (torch.bfloat16, {
        "master_weights": True, "store_param_remainders": True,
        "exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16,
    }),
    "fp16-fp32-master-fp16-moments": (torch.float16, {
        "master_weights": True, "exp_avg_dtype": torch.float16, "exp_avg_sq_dtype": torch.float16,
    }),
    "fp32-bf16-moment": (torch.float32, {"exp_avg_dtype": torch.bfloat16}),
}


@path_ids
@pytest.mark.parametrize(("dtype", "config"), CONFIGS.values(), ids=CONFIGS.keys())
def test_state_dict_round_trip_keeps_dtypes_and_resumes_bitwise(dtype: torch.dtype, config: dict[str, Any], path: str) -> None:
    config = config | PATHS[path][0]
    params = _params(dtype)
    opt = PrecisionAwareAdam(params, **config, **HYPER)
    generator = torch.Generator().manual_seed(12)
    grads = [_grads(params, generator) for _ in range(10)]
    for step_grads in grads[:5]:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()

    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = PrecisionAwareAdam(twin_params, **config, **HYPER)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(params, twin_params):
        assert {k: v.dtype for k, v in opt.state[p].items()} == {k: v.dtype for k, v in twin.state[q].items()}
    assert [(g["fused"], g["foreach"]) for g in twin.param_groups] == [(g["fused"], g["foreach"]) for g in opt.param_groups]

    for step_grads in grads[5:]:
        for p, q, g in zip(params, twin_params, step_grads):
            p.grad, q.grad = g, g.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        _assert_bitwise(q.detach(), p.detach())
        for key, value in opt.state[p].items():
            _assert_bitwise(twin.state[q][key], value, key)


def test_load_state_dict_casts_moments_to_the_loading_optimizers_dtypes() -> None:
    params = _params(torch.float32)
    opt = PrecisionAwareAdam(params)
    for p, g in zip(params, _grads(params, torch.Generator().manual_seed(13))):
        p.grad = g
    opt.step()
    low = PrecisionAwareAdam(params, exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.float16)
    low.load_state_dict(opt.state_dict())
    for p in params:
        _assert_bitwise(low.state[p]["exp_avg"], opt.state[p]["exp_avg"].to(torch.bfloat16))
        _assert_bitwise(low.state[p]["exp_avg_sq"], opt.state[p]["exp_avg_sq"].to(torch.float16))
        assert low.state[p]["step"] is not opt.state[p]["step"]  # a copy: stepping one leaves the other


@pytest.mark.parametrize(
    ("saving", "loading", "message"),
    [
        ({}, {"master_weights": True}, r"got none; expected a float copy"),
        ({"master_weights": True}, {}, r"got a torch.float32 copy; expected none"),
        ({"master_weights": True, "store_param_remainders": True}, {"master_weights": True}, r"got int16 remainders; expected a float copy"),
        ({"master_weights": True}, {"master_weights": True, "store_param_remainders": True}, r"got a torch.float32 copy; expected int16 remainders"),
    ],
)
def test_load_state_dict_rejects_another_master_representation(saving: dict[str, Any], loading: dict[str, Any], message: str) -> None:
    params = _params(torch.bfloat16)
    opt = PrecisionAwareAdam(params, **saving)
    for p, g in zip(params, _grads(params, torch.Generator().manual_seed(14))):
        p.grad = g
    opt.step()
    other = PrecisionAwareAdam(params, **loading)
    with pytest.raises(ValueError, match=r"`state_dict\['state'\]\[0\]\['master_param'\]`: saved master differs from this optimizer's .*; " + message):
        other.load_state_dict(opt.state_dict())
    assert not other.state  # a rejected state dict changes nothing


def test_load_state_dict_takes_the_kernel_from_the_state_dict_as_torch_does() -> None:
    params = _params(torch.float32)
    plain = PrecisionAwareAdam(params, **PATHS["plain"][0])
    for p, g in zip(params, _grads(params, torch.Generator().manual_seed(16))):
        p.grad = g
    plain.step()
    assert (plain.state_dict()["param_groups"][0]["fused"], plain.state_dict()["param_groups"][0]["foreach"]) == (False, False)
    default = PrecisionAwareAdam(params)
    default.load_state_dict(plain.state_dict())
    assert (default.param_groups[0]["fused"], default.param_groups[0]["foreach"]) == (False, False)

    old_format = copy.deepcopy(plain.state_dict())
    for group in old_format["param_groups"]:  # saved before the kernel options existed
        del group["fused"], group["foreach"]
    default = PrecisionAwareAdam(params)
    default.load_state_dict(old_format)
    assert (default.param_groups[0]["fused"], default.param_groups[0]["foreach"]) == (True, False)
    for p in params:
        _assert_bitwise(default.state[p]["exp_avg"], plain.state[p]["exp_avg"])


def test_load_state_dict_rejects_a_fused_kernel_the_device_lacks() -> None:
    on_meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    opt = PrecisionAwareAdam(on_meta)
    state_dict = opt.state_dict()
    state_dict["param_groups"][0].update(fused=True, foreach=False)
    with pytest.raises(ValueError, match=r"`state_dict\['param_groups'\]\[0\]`: `fused`: torch has no fused Adam kernel for these params; got devices \['meta'\]"):
        opt.load_state_dict(state_dict)
    assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (False, True)


def test_get_optimizer_uses_the_fused_path_and_its_checkpoints_keep_step_as_torch_places_it() -> None:
    """optzoo's wrapper places ``step`` by the group's ``fused`` key when it loads a checkpoint."""
    from optzoo import OptimizerConfig, get_optimizer
    from tests.conftest import tiny_gpt, tokens

    config = OptimizerConfig(lr=1e-3, bf16=True, use_precision_aware_optimizer=True)
    model = tiny_gpt().to(torch.bfloat16)
    opt = get_optimizer(config, model)
    assert all(g["fused"] is True and g["foreach"] is False for g in opt.param_groups)
    opt.scale_loss(model.loss(tokens())).backward()  # type: ignore[no-untyped-call]
    opt.step()
    fresh_model = tiny_gpt().to(torch.bfloat16)
    fresh_model.load_state_dict(model.state_dict())
    fresh = get_optimizer(config, fresh_model)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for param in fresh_model.parameters():
        step = fresh.state[param]["step"]
        assert step.dtype == torch.float32 and step.device == param.device and step.item() == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; the CPU tests above cover every path")
def test_fused_path_on_cuda_keeps_step_on_the_device_and_equals_torch_fused_bitwise() -> None:
    device = torch.device("cuda")
    params = [torch.nn.Parameter(p.detach().to(device)) for p in _params(torch.bfloat16)]
    reference = MasterAdam(params, to_model=round_half_away_to_bf16, kernel="fused", **HYPER)
    ours = PrecisionAwareAdam(params, master_weights=True, store_param_remainders=True, **HYPER)
    assert ours.param_groups[0]["fused"] is True
    generator = torch.Generator().manual_seed(17)
    for _ in range(20):
        grads = [g.to(device) for g in _grads(params, generator)]
        for p, g in zip(params, grads):
            p.grad = g
        ours.step()
        reference.step(grads)
    for i, (p, expected) in enumerate(zip(params, reference.model())):
        _assert_bitwise(p.detach(), expected, f"param {i}")
        step = ours.state[p]["step"]
        assert step.device == p.device and step.dtype == torch.float32 and step.item() == 20
    twin = PrecisionAwareAdam(params, master_weights=True, store_param_remainders=True, **HYPER)
    twin.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert all(twin.state[p]["step"].device == p.device for p in params)


# --- bad arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"lr": -1.0}, ValueError, r"param group #0: `lr`: must be non-negative; got -1.0; expected lr >= 0"),
        ({"eps": -1e-8}, ValueError, r"param group #0: `eps`: must be non-negative; got -1e-08; expected eps >= 0"),
        ({"weight_decay": -0.1}, ValueError, r"param group #0: `weight_decay`: must be non-negative; got -0.1"),
        ({"betas": (1.0, 0.999)}, ValueError, r"param group #0: `betas`: each must lie in \[0, 1\); got \(1.0, 0.999\)"),
        ({"betas": (0.9, -0.1)}, ValueError, r"param group #0: `betas`: .*; got \(0.9, -0.1\)"),
        ({"exp_avg_dtype": torch.float64}, ValueError, r"`exp_avg_dtype`: unsupported dtype; got torch.float64; expected one of \(torch.float32, torch.bfloat16, torch.float16\)"),
        ({"exp_avg_sq_dtype": torch.uint8}, ValueError, r"`exp_avg_sq_dtype`: unsupported dtype; got torch.uint8"),
        ({"exp_avg_dtype": "bf16"}, TypeError, r"`exp_avg_dtype`: must be a torch.dtype; got 'bf16'"),
        ({"master_weights": True, "master_weight_dtype": torch.float64}, ValueError, r"`master_weight_dtype`: unsupported dtype; got torch.float64"),
        ({"master_weight_dtype": torch.bfloat16}, ValueError, r"`master_weight_dtype`: takes effect only with master_weights=True; got torch.bfloat16 with master_weights=False"),
        ({"store_param_remainders": True}, ValueError, r"`store_param_remainders`: .*; got master_weights=False; expected master_weights=True or store_param_remainders=False"),
        ({"store_param_remainders": True, "master_weights": True, "master_weight_dtype": torch.float16}, ValueError, r"`store_param_remainders`: .*; got master_weight_dtype=torch.float16; expected torch.float32"),
        ({"fused": True, "foreach": True}, ValueError, r"param group #0: `fused`, `foreach`: pick one kernel; got fused=True, foreach=True; expected at most one True"),
        ({"fused": 1}, TypeError, r"param group #0: `fused`: must be a bool or None; got 1; expected True, False or None"),
        ({"foreach": "yes"}, TypeError, r"param group #0: `foreach`: must be a bool or None; got 'yes'"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        PrecisionAwareAdam(_params(torch.bfloat16), **kwargs)


def test_bad_params_raise_with_their_group_and_index() -> None:
    bf16, fp32 = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(2))
    lr_groups: list[dict[str, Any]] = [{"params": [fp32]}, {"params": [bf16], "lr": -0.5}]
    with pytest.raises(ValueError, match=r"param group #1, param #1: `store_param_remainders` needs bf16 params .*; got torch.float32; expected torch.bfloat16"):
        groups: list[dict[str, Any]] = [{"params": [bf16]}, {"params": [torch.ones(2, dtype=torch.bfloat16), fp32]}]
        PrecisionAwareAdam(groups, master_weights=True, store_param_remainders=True)
    with pytest.raises(ValueError, match=r"param group #0, param #0 \(`w`\): `store_param_remainders` needs bf16 params"):
        PrecisionAwareAdam([("w", fp32)], master_weights=True, store_param_remainders=True)
    with pytest.raises(TypeError, match=r"param group #0, param #0: dtype not supported; got torch.int64; expected one of"):
        PrecisionAwareAdam([torch.ones(2, dtype=torch.int64)])
    with pytest.raises(ValueError, match=r"param group #1: `lr`: must be non-negative; got -0.5"):
        PrecisionAwareAdam(lr_groups)
    opt = PrecisionAwareAdam([fp32])
    with pytest.raises(ValueError, match=r"param group #1: `betas`"):
        opt.add_param_group({"params": [bf16], "betas": (0.9, 1.5)})
    assert len(opt.param_groups) == 1  # the rejected group was not kept


def test_data_dependent_errors_raise_during_step() -> None:
    param = torch.nn.Parameter(torch.ones(3, 4))
    opt = PrecisionAwareAdam([param])
    param.grad = torch.eye(3, 4).to_sparse()
    with pytest.raises(ValueError, match=r"param group #0, param #0: `grad` is sparse, which Adam does not support; got torch.sparse_coo; expected torch.strided"):
        opt.step()

    decoupled = PrecisionAwareAdam([param], use_decoupled_grad=True)
    param.decoupled_grad = torch.ones(4, 3)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"`decoupled_grad` shape differs from the param's; got \(4, 3\); expected \(3, 4\)"):
        decoupled.step()
    param.decoupled_grad = torch.ones(3, 4, dtype=torch.int32)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match=r"`decoupled_grad` must be floating point; got torch.int32"):
        decoupled.step()

    bf16 = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    remainders = PrecisionAwareAdam([bf16], master_weights=True, store_param_remainders=True)
    bf16.data = bf16.data.float()  # cast after construction
    bf16.grad = torch.ones(3)
    with pytest.raises(ValueError, match=r"param group #0, param #0: `store_param_remainders` needs bf16 params .*; got torch.float32; expected torch.bfloat16"):
        remainders.step()


@pytest.mark.parametrize(
    "kernel",
    [{"fused": True, "compiled": False}, {"fused": True, "compiled": True}, {"foreach": True}, {"fused": False, "foreach": False}],
)
def test_torchs_grad_scaler_protocol_divides_and_skips_on_every_kernel(kernel: dict[str, bool]) -> None:
    """torch.amp.GradScaler sets ``grad_scale`` and ``found_inf`` on optimizers that declare
    ``_step_supports_amp_scaling`` and then leaves the skip to them: every kernel must honour both."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 3, dtype=torch.bfloat16)) for _ in range(2)]  # 48: compiled too
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    settings: dict[str, Any] = {"lr": 1e-2, "master_weights": True, "store_param_remainders": True, **kernel}
    ours, reference = PrecisionAwareAdam(params, **settings), PrecisionAwareAdam(twins, **settings)
    assert ours._step_supports_amp_scaling
    grads = [torch.randn(16, 3) for _ in params]
    for p, q, g in zip(params, twins, grads):
        p.grad, q.grad = (g * 8).bfloat16(), g.bfloat16()
    ours.grad_scale, ours.found_inf = torch.tensor(8.0), torch.tensor(0.0)  # type: ignore[attr-defined]
    ours.step()
    reference.step()
    for p, q in zip(params, twins):
        _assert_bitwise(p.detach(), q.detach())  # a power-of-two scale divides exactly
    before = [(p.detach().clone(), {k: v.clone() for k, v in ours.state[p].items()}) for p in params]
    ours.found_inf = torch.tensor(1.0)  # type: ignore[attr-defined]
    ours.step()
    for p, (value, state) in zip(params, before):
        _assert_bitwise(p.detach(), value)
        for key, saved in state.items():
            _assert_bitwise(ours.state[p][key], saved, key)


# --- the compiled remainder update --------------------------------------------------------------

COMPILED_SHAPES = [(64, 33), (1024,), (16,), (7,), (3, 5), (34,)]
"""Counts that are multiples of 16 take the compiled update; (7,), (3, 5) and (34,) the fused kernel."""


def _step_remainder_adam(
    compiled: bool, moments: tuple[torch.dtype, torch.dtype], grad_dtype: torch.dtype, steps: int, **hyper: Any
) -> tuple[PrecisionAwareAdam, list[torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in COMPILED_SHAPES]
    decoupled_grad = grad_dtype != torch.bfloat16  # p.grad must have the param's dtype
    opt = PrecisionAwareAdam(
        params, master_weights=True, store_param_remainders=True, exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1],
        use_decoupled_grad=decoupled_grad, compiled=compiled, **hyper,
    )
    for step in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=generator).to(grad_dtype)
            setattr(p, "decoupled_grad" if decoupled_grad else "grad", grad)
        if step % 2:  # torch's GradScaler protocol, as optzoo's folded clip uses it
            opt.grad_scale = torch.tensor([2.0 ** (step % 5) / 3])  # type: ignore[attr-defined]
        elif hasattr(opt, "grad_scale"):
            del opt.grad_scale
        opt.step()
    return opt, params


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "moments", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
    ids=["bf16-moments", "fp32-moments", "mixed-moments"],
)
def test_compiled_update_is_bit_identical_to_the_fused_kernel(moments: tuple[torch.dtype, torch.dtype], grad_dtype: torch.dtype) -> None:
    """Every setting the compiled graph selects between: AdamW, L2 and no decay, lerp weights below
    and above 0.5 (torch's lerp takes another formula there), with and without a loss scale."""
    settings = [
        {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
        {"lr": 3e-3, "betas": (0.3, 0.999), "eps": 1e-6, "weight_decay": 0.1, "decoupled_weight_decay": False},
        {"lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.0},
    ]
    for hyper in settings:
        compiled, params = _step_remainder_adam(True, moments, grad_dtype, 12, **hyper)
        fused, twins = _step_remainder_adam(False, moments, grad_dtype, 12, **hyper)
        assert compiled.compile_failure is None and compiled.compile_seconds is not None
        for i, (p, q) in enumerate(zip(params, twins)):
            where = f"{hyper}, param {COMPILED_SHAPES[i]}"
            _assert_bitwise(p.detach(), q.detach(), where)
            for key in ("exp_avg", "exp_avg_sq", "master_param", "step"):
                _assert_bitwise(compiled.state[p][key], fused.state[q][key], f"{where}: {key}")


def test_compiled_update_writes_the_eager_kernels_bits_for_nan_and_inf_gradients() -> None:
    """Garbage in, the same garbage out: NaN moments carry the NaN bits torch's ``.to(bfloat16)``
    writes (0xFFFF), and masters the bits the eager split writes."""
    results = []
    for compiled in (True, False):
        params = [torch.nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(5)).bfloat16())]
        opt = PrecisionAwareAdam(params, master_weights=True, store_param_remainders=True, exp_avg_dtype=torch.bfloat16,
                                 exp_avg_sq_dtype=torch.bfloat16, compiled=compiled)
        for step in range(3):
            grad = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
            grad[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
            params[0].grad = grad
            opt.step()
        state = opt.state[params[0]]
        results.append([params[0].detach().view(torch.int16)] + [state[k].view(torch.int16) for k in ("exp_avg", "exp_avg_sq", "master_param")])
    assert torch.isnan(results[0][1].view(torch.bfloat16)).any()
    for name, ours, eager in zip(["param", "exp_avg", "exp_avg_sq", "master_param"], *results):
        assert torch.equal(ours, eager), name


def test_compiled_update_equals_torch_adamw_on_fp32_masters() -> None:
    """Against the independent reference: torch.optim.AdamW(fused=True) on fp32 masters, the model
    param rounded half away from zero and the moments stored in bf16 (nothing shared with the graph)."""
    generator = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator).bfloat16()) for shape in [(32, 48), (256,)]]
    dtypes: dict[str, Any] = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16}
    reference = MasterAdam(params, to_model=round_half_away_to_bf16, kernel="fused", **dtypes, **HYPER)
    ours = PrecisionAwareAdam(params, master_weights=True, store_param_remainders=True, compiled=True, **dtypes, **HYPER)
    _step_remainders_beside(ours, reference, params, generator, steps=100)
    assert ours.compile_seconds is not None


def test_a_failed_compile_logs_once_and_the_fused_kernel_steps(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_compiler(fn: Any, **options: Any) -> Any:
        def failing(*args: Any) -> None:
            raise torch._dynamo.exc.InternalTorchDynamoError("InvalidCxxCompiler: No working C++ compiler found")
        return failing

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(precision_adam, "_VARIANTS", {})  # not the functions earlier tests compiled
    fused, twins = _step_remainder_adam(False, (torch.bfloat16, torch.bfloat16), torch.bfloat16, 4)
    with caplog.at_level("WARNING", logger="optzoo.optimizers.precision_adam"):
        failed, params = _step_remainder_adam(True, (torch.bfloat16, torch.bfloat16), torch.bfloat16, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "PrecisionAwareAdam: torch.compile is unavailable (InternalTorchDynamoError: InvalidCxxCompiler: No working C++ "
        "compiler found); using the eager kernels"
    ]
    assert failed.compile_failure is not None and failed.compile_seconds is None
    for p, q in zip(params, twins):
        _assert_bitwise(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq", "master_param", "step"):
            _assert_bitwise(failed.state[p][key], fused.state[q][key], key)


def test_compiled_option_is_checked() -> None:
    (w,) = _params(torch.bfloat16)[:1]
    with pytest.raises(TypeError, match=r"^`compiled`: must be a bool; got 'yes'; expected True or False$"):
        PrecisionAwareAdam([w], master_weights=True, store_param_remainders=True, compiled="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^`compiled`: the compiled update is written for bf16 params with int16 remainders; "
                       r"got store_param_remainders=False; expected store_param_remainders=True, or compiled=False$"):
        PrecisionAwareAdam([w], master_weights=True, compiled=True)
    plain = PrecisionAwareAdam([w], master_weights=True)
    with pytest.raises(ValueError, match=r"^`compiled`: the compiled update is written for bf16 params with int16 remainders; "):
        plain.compiled = True  # set later, as on the optimizer get_optimizer built: checked the same
    assert plain.compiled is False


@path_ids
@pytest.mark.parametrize("remainders", [False, True], ids=["fp32", "bf16-remainders"])
def test_a_gradient_laid_out_otherwise_gives_the_update_of_a_contiguous_one(path: str, remainders: bool) -> None:
    """torch's fused kernel walks memory order: a transposed gradient is brought into the
    master's layout first (torch.optim.AdamW(fused=True) would update the wrong elements)."""
    options, _ = PATHS[path]
    dtype = torch.bfloat16 if remainders else torch.float32
    generator = torch.Generator().manual_seed(11)
    grad = torch.randn(8, 4, generator=generator).to(dtype)
    transposed = grad.t().contiguous().t()
    assert torch.equal(transposed, grad) and transposed.stride() != grad.stride()
    results = []
    for g in (grad, transposed):
        w = torch.nn.Parameter(torch.randn(8, 4, generator=torch.Generator().manual_seed(12)).to(dtype))
        opt = PrecisionAwareAdam([w], lr=0.1, master_weights=remainders, store_param_remainders=remainders, **options)
        for _ in range(3):
            w.grad = g.clone(memory_format=torch.preserve_format)
            opt.step()
        results.append((w.detach(), opt.state[w]["exp_avg"]))
    _assert_bitwise(results[1][0], results[0][0], "param")
    _assert_bitwise(results[1][1], results[0][1], "exp_avg")
