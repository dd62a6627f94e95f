"""Which Newton–Schulz kernel Muon runs: measured once per device, dtype and shape class, not ruled by device type.

A kernel (:class:`Kernel`) is a variant (``standard`` or ``gram``), a loop precision
(:data:`~optzoo.optimizers.newton_schulz.LoopPrecision`: ``ieee``, ``tf32`` or ``bf16``), from
:data:`SYMMETRIC_BLOCKS_PROBE_ROWS` rows symmetric blocks (torch's stand-in for SYRK) or dense
products, and whether a batch runs stacked (one batched call) or per matrix. ``matmul_precision`` (Megatron's
``muon_fp32_matmul_prec``) is the accuracy ceiling: :func:`allowed_kernels` lists what it allows
(``highest``: IEEE only; ``high``: also TF32 where the device has it; ``medium``: also bf16; Gram
only with IEEE matmuls, stacked and per-matrix only for batches of 2 or more).

:func:`choose_kernel` answers per (device, dtype, shape class, batch class, ceiling, steps), in this
order: a pinned kernel (``Muon(ns_variant=...)`` or the ``OPTZOO_NS_VARIANT`` environment variable;
``auto`` is the old FLOPs and device-type rule); this process's memory; the disk cache
(``OPTZOO_NS_CACHE``: a JSON file, keyed by device name, thread count and torch version); under a
process group of more than one rank, the rule (ranks timing on their own could pick differently,
and their results would then differ in the last bits, while a collective inside a step that not
every rank takes could hang: measure once in one process with ``OPTZOO_NS_CACHE`` set, and every
rank reads the same file); else a measurement (:func:`measure`).

The measurement times each allowed kernel on a sample of at most :data:`PROBE_SAMPLE_MATRICES`
matrices of the actual batch: every kernel runs at least once (so none is left out), and again, up
to :data:`PROBE_MAX_REPEATS` times, while its share of :data:`PROBE_BUDGET_S` lasts; the fastest run
of each counts. :func:`probe_report` returns what was chosen, each kernel's time and the probe's own
cost, for every key this process decided.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final, Literal, NamedTuple, get_args

import torch
import torch.distributed as dist

from .._common import check_choice
from .newton_schulz import LOOP_PRECISIONS, CoefficientType, LoopPrecision, MatmulPrecision, _float32_matmul_precision, newton_schulz

__all__ = [
    "CACHE_ENV",
    "ENV_SUBJECT",
    "Kernel",
    "KernelSetting",
    "PROBE_BUDGET_S",
    "PROBE_MAX_REPEATS",
    "PROBE_SAMPLE_MATRICES",
    "SCREEN_BLOCK",
    "SCREEN_ROUNDS",
    "SYMMETRIC_BLOCKS_PROBE_ROWS",
    "ProbeKey",
    "ProbeRecord",
    "VARIANT_ENV",
    "allowed_kernels",
    "check_kernel_setting",
    "choose_kernel",
    "clear_probe_cache",
    "disk_choice",
    "measure",
    "probe_key",
    "probe_report",
    "run_kernel",
    "screen_loops",
]

VARIANT_ENV: Final = "OPTZOO_NS_VARIANT"
"""Environment variable that pins the kernel of every Muon built without ``ns_variant``."""
ENV_SUBJECT: Final = f"environment variable {VARIANT_ENV}"
"""How errors name a pin from the environment."""
CACHE_ENV: Final = "OPTZOO_NS_CACHE"
"""Environment variable naming the JSON file the probe reads its choices from and writes them to."""
PROBE_BUDGET_S: Final = 0.2
"""Seconds of repetitions per key, shared among the kernels; each kernel runs once regardless."""
PROBE_MAX_REPEATS: Final = 3
"""Timed runs per kernel at most; the fastest counts (noise only ever adds time)."""
PROBE_SAMPLE_MATRICES: Final = 2
"""Matrices of the batch the kernels are timed on: enough to compare stacked and per-matrix runs."""
SCREEN_BLOCK: Final = (256, 1024)
"""At most this block (short side x long side) of one matrix is what :func:`screen_loops` multiplies."""
SCREEN_ROUNDS: Final = 3
"""Timed products per loop precision in the screen, taken in turn; the fastest counts."""

KernelSetting = str
"""``probe`` (measure), ``auto`` (the FLOPs and device-type rule) or a kernel such as ``gram/ieee``."""
Source = Literal["measured", "disk cache", "pinned", "rule under a process group"]

_LOGGER = logging.getLogger(__name__)


class Kernel(NamedTuple):
    """One way to run Newton–Schulz on a batch; written ``variant/loop[/blocks|/dense][/per-matrix]``."""

    variant: Literal["standard", "gram"]
    loop: LoopPrecision
    stacked: bool = True
    blocks: bool | None = None
    """Symmetric blocks (``True``), dense ``m × m`` products (``False``) or the engine's row threshold (``None``)."""

    def __str__(self) -> str:
        blocks = "" if self.blocks is None else "/blocks" if self.blocks else "/dense"
        return f"{self.variant}/{self.loop}{blocks}" + ("" if self.stacked else "/per-matrix")

    @staticmethod
    def parse(text: str, subject: str = "`ns_variant`") -> Kernel:
        """The kernel ``text`` names; raises ValueError listing the valid forms."""
        parts = text.split("/") if isinstance(text, str) else []
        if len(parts) >= 2 and parts[0] in ("standard", "gram") and parts[1] in get_args(LoopPrecision):
            rest = parts[2:]
            blocks = rest.pop(0) if rest and rest[0] in ("blocks", "dense") else None
            if rest in ([], ["per-matrix"]):
                kernel = Kernel(parts[0], parts[1], not rest, None if blocks is None else blocks == "blocks")  # type: ignore[arg-type]  # checked above
                if kernel.variant == "gram" and kernel.loop != "ieee":
                    raise ValueError(
                        f"{subject}: Gram Newton-Schulz squares the condition number and needs IEEE matmuls; "
                        f"got {text!r}; expected 'gram/ieee', or a standard kernel"
                    )
                if kernel.blocks and kernel.loop == "bf16":
                    raise ValueError(f"{subject}: symmetric blocks are too coarse in bf16; got {text!r}; expected 'standard/bf16'")
                return kernel
        raise ValueError(
            f"{subject}: unknown kernel; got {text!r}; expected 'probe', 'auto' or "
            "'<standard|gram>/<ieee|tf32|bf16>[/blocks|/dense][/per-matrix]' (gram with ieee only)"
        )


def check_kernel_setting(setting: object, subject: str = "`ns_variant`") -> KernelSetting:
    """``setting`` if it is ``probe``, ``auto`` or a kernel (:meth:`Kernel.parse`); raises otherwise."""
    if not isinstance(setting, str):
        raise TypeError(f"{subject}: must be a string; got {type(setting).__name__}; expected 'probe', 'auto' or a kernel")
    if setting not in ("probe", "auto"):
        Kernel.parse(setting, subject)
    return setting


def _has_tf32(device: torch.device) -> bool:
    """TF32 matmuls exist on CUDA from compute capability 8.0 (Ampere); elsewhere torch's ``high`` is ``highest``."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 0)


SYMMETRIC_BLOCKS_PROBE_ROWS: Final = 512
"""From this short side the probe times symmetric blocks against dense products (the engine's own
threshold, 1024 rows, was measured on one 2-core CPU); below it, blocks lose everywhere measured."""


def allowed_kernels(
    matmul_precision: MatmulPrecision, dtype: torch.dtype, device: torch.device, batch: int, short_side: int = 0
) -> list[Kernel]:
    """The kernels ``matmul_precision`` allows for a ``batch`` of ``dtype`` matrices on ``device``, most accurate first.

    Example:
        >>> [str(k) for k in allowed_kernels("medium", torch.float32, torch.device("cpu"), 1)]
        ['standard/ieee', 'gram/ieee', 'standard/bf16']
    """
    check_choice("`matmul_precision`", matmul_precision, LOOP_PRECISIONS)
    loops = [loop for loop in LOOP_PRECISIONS[matmul_precision] if loop != "tf32" or _has_tf32(device)]
    if dtype == torch.float64:  # float64 computes in float64 whatever the loop says
        loops = ["ieee"]
    kernels = [Kernel("standard", "ieee"), Kernel("gram", "ieee")] + [Kernel("standard", loop) for loop in loops if loop != "ieee"]
    if short_side >= SYMMETRIC_BLOCKS_PROBE_ROWS:  # blocks against dense, outside a bf16 loop
        kernels = [k._replace(blocks=b) for k in kernels for b in ((True, False) if k.loop != "bf16" else (None,))]
    if batch > 1:
        kernels += [kernel._replace(stacked=False) for kernel in kernels]
    return kernels


def run_kernel(
    x: torch.Tensor, kernel: Kernel | None, *, steps: int, coefficient_type: CoefficientType, matmul_precision: MatmulPrecision
) -> torch.Tensor:
    """:func:`~optzoo.optimizers.newton_schulz.newton_schulz` of ``x`` with ``kernel`` (``None``: the rule)."""
    if kernel is None:
        return newton_schulz(x, steps=steps, coefficient_type=coefficient_type, matmul_precision=matmul_precision)

    def one(matrices: torch.Tensor) -> torch.Tensor:
        return newton_schulz(
            matrices, steps=steps, coefficient_type=coefficient_type, matmul_precision=matmul_precision,
            variant=kernel.variant, loop_precision=kernel.loop, symmetric_blocks=kernel.blocks,
        )  # fmt: skip

    if kernel.stacked or x.ndim == 2:
        return one(x)
    flat = x.reshape(-1, *x.shape[-2:])
    return torch.stack([one(matrix) for matrix in flat]).reshape(x.shape)


class ProbeKey(NamedTuple):
    """What a choice is valid for: shapes are classed orientation-free, batches by powers of two."""

    device: str
    dtype: str
    short: int
    long: int
    batch_class: int
    matmul_precision: str
    steps: int

    def disk_key(self) -> str:
        """The key in the disk cache (the device's index left out: the file is keyed by device name)."""
        return f"{self.dtype} {self.short}x{self.long} batch<={self.batch_class} {self.matmul_precision} steps={self.steps}"


def probe_key(x: torch.Tensor, *, steps: int, matmul_precision: MatmulPrecision) -> ProbeKey:
    rows, cols = x.shape[-2:]
    batch = max(1, x.numel() // max(1, rows * cols))
    return ProbeKey(
        str(x.device), str(x.dtype).removeprefix("torch."), min(rows, cols), max(rows, cols),
        1 << (batch - 1).bit_length(), matmul_precision, steps,
    )  # fmt: skip


@dataclass
class ProbeRecord:
    """What was decided for one :class:`ProbeKey`, and what it cost."""

    key: ProbeKey
    kernel: str
    """The kernel chosen (``auto``: the FLOPs and device-type rule)."""
    source: Source
    seconds: dict[str, float] = field(default_factory=dict)
    """Each timed kernel's fastest run on the sample, in seconds (empty unless measured here or read from disk)."""
    runs: dict[str, int] = field(default_factory=dict)
    """Runs of each kernel, the untimed first one included."""
    probe_seconds: float = 0.0
    """Wall time the probe spent on this key (0 unless measured in this process)."""
    sample_matrices: int = 0
    screen: dict[str, float] = field(default_factory=dict)
    """Each loop precision's time for one ``X Xᵀ`` on a block of the sample (:func:`screen_loops`),
    where the ceiling allows more than one; empty otherwise."""
    screened_out: list[str] = field(default_factory=list)
    """The kernels not timed: their loop's product was slower than IEEE's, so the IEEE kernel of the
    same form beats them (a bf16 loop on a CPU without bf16 matmul units costs many times fp32's)."""


_records: dict[ProbeKey, ProbeRecord] = {}
_timer: Callable[[], float] = time.perf_counter
"""The probe's clock; tests inject a fake one."""


def probe_report() -> list[ProbeRecord]:
    """Every decision of this process, in the order they were made.

    Example:
        >>> isinstance(probe_report(), list)
        True
    """
    return list(_records.values())


def clear_probe_cache() -> None:
    """Forget this process's decisions (the disk cache is left alone)."""
    _records.clear()


def choose_kernel(
    x: torch.Tensor, *, steps: int, matmul_precision: MatmulPrecision, coefficient_type: CoefficientType,
    setting: KernelSetting | None = None,
) -> Kernel | None:  # fmt: skip
    """The kernel to run ``x`` (a matrix or a batch of them) with, or ``None`` for the rule.

    Args:
        setting: ``probe``, ``auto`` or a kernel; ``None``: the :data:`VARIANT_ENV` environment
            variable's value, else ``probe``.

    Raises:
        ValueError: the setting is unknown, or pins a kernel coarser than ``matmul_precision`` allows.
    """
    subject = "`ns_variant`"
    if setting is None:
        setting = os.environ.get(VARIANT_ENV) or "probe"
        subject = ENV_SUBJECT
    check_kernel_setting(setting, subject)
    if setting == "auto" or x.numel() == 0:
        return None
    if setting != "probe":
        kernel = Kernel.parse(setting, subject)
        allowed = LOOP_PRECISIONS[matmul_precision]
        if kernel.loop not in allowed:
            raise ValueError(
                f"{subject}: runs {kernel.loop} matmuls, coarser than muon_fp32_matmul_prec={matmul_precision!r} allows; "
                f"got {setting!r}; expected a kernel with loop precision in {list(allowed)}, or 'probe'"
            )
        return kernel
    key = probe_key(x, steps=steps, matmul_precision=matmul_precision)
    record = _records.get(key)
    if record is None:
        record = _from_disk(key) or _rule_under_process_group(key) or measure(
            x, key=key, steps=steps, coefficient_type=coefficient_type, matmul_precision=matmul_precision
        )
        _records[key] = record
        if record.source == "measured":
            _to_disk(record)
            _LOGGER.debug("newton_schulz probe: %s -> %s (%s)", key.disk_key(), record.kernel, _seconds_text(record))  # DEBUG: a default run stays silent at INFO (issue 25)
    return None if record.kernel == "auto" else Kernel.parse(record.kernel)


def _rule_under_process_group(key: ProbeKey) -> ProbeRecord | None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ProbeRecord(key, "auto", "rule under a process group")
    return None


def measure(
    x: torch.Tensor, *, key: ProbeKey, steps: int, coefficient_type: CoefficientType, matmul_precision: MatmulPrecision
) -> ProbeRecord:
    """Time the allowed kernels on a sample of ``x`` and choose the fastest (ties: the more accurate).

    First a screen (:func:`screen_loops`) drops the loop precisions whose product is slower than
    IEEE's. Then the search goes in stages, each from the fastest kernel so far: the dense forms
    of each variant and loop, stacked; that winner with symmetric blocks (where allowed); then the
    winner per matrix (a batch). Every timed kernel runs at least once; more runs (up to
    :data:`PROBE_MAX_REPEATS`) while its share of :data:`PROBE_BUDGET_S` lasts. The outputs are
    dropped. Global settings are left as found (each run is
    :func:`~optzoo.optimizers.newton_schulz.newton_schulz`, which restores torch's precision flags).
    """
    matrices = x.reshape(-1, *x.shape[-2:])
    sample = matrices[:PROBE_SAMPLE_MATRICES]
    allowed = allowed_kernels(matmul_precision, x.dtype, x.device, len(sample), min(x.shape[-2:]))
    record = ProbeRecord(key, "", "measured", sample_matrices=len(sample))
    start = _timer()
    loops = list(dict.fromkeys(kernel.loop for kernel in allowed))
    if len(loops) > 1:
        # A kernel's first run is never cut short, so a loop far slower than fp32 (bf16 emulated on
        # a CPU without bf16 units: seconds per run) is screened out by one cheap product first.
        record.screen = screen_loops(sample[0], loops)
        record.screened_out = [str(kernel) for kernel in allowed if record.screen[kernel.loop] > record.screen["ieee"]]
        allowed = [kernel for kernel in allowed if str(kernel) not in record.screened_out]
    order = {kernel: index for index, kernel in enumerate(allowed)}
    forms = [kernel for kernel in allowed if kernel.stacked and not kernel.blocks]
    refinements: list[Callable[[Kernel], Kernel]] = []
    if any(kernel.blocks for kernel in allowed):
        refinements.append(lambda kernel: kernel._replace(blocks=True))
    if any(not kernel.stacked for kernel in allowed):
        refinements.append(lambda kernel: kernel._replace(stacked=False))
    share = PROBE_BUDGET_S / (len(forms) + len(refinements))

    def fastest_so_far() -> Kernel:
        return min((Kernel.parse(name) for name in record.seconds), key=lambda kernel: (record.seconds[str(kernel)], order[kernel]))

    def time_kernel(kernel: Kernel) -> None:
        def run_once() -> float:
            before = _timer()
            run_kernel(sample, kernel, steps=steps, coefficient_type=coefficient_type, matmul_precision=matmul_precision)
            _synchronize(x.device)
            return _timer() - before

        spent = first = run_once()  # warms up; counts only when it alone uses up the share
        runs, fastest = 1, first if first >= share else float("inf")
        while first < share and runs <= PROBE_MAX_REPEATS and (runs == 1 or spent < share):
            elapsed = run_once()
            spent, runs, fastest = spent + elapsed, runs + 1, min(fastest, elapsed)
        record.seconds[str(kernel)], record.runs[str(kernel)] = fastest, runs

    for kernel in forms:
        time_kernel(kernel)
    for refine in refinements:
        candidate = refine(fastest_so_far())
        if candidate in order and str(candidate) not in record.seconds:
            time_kernel(candidate)
    record.probe_seconds = _timer() - start
    record.kernel = str(fastest_so_far())
    return record


def screen_loops(matrix: torch.Tensor, loops: list[LoopPrecision]) -> dict[str, float]:
    """Seconds of one ``X Xᵀ`` at each loop precision, ``X`` at most :data:`SCREEN_BLOCK` of ``matrix``.

    Every kernel of a loop runs products of this kind, so a loop whose product is slower than the
    IEEE one loses to the IEEE kernel of the same form. Each product runs once untimed, then
    :data:`SCREEN_ROUNDS` times in turn with the others; the fastest run counts.
    """
    block = matrix.mT if matrix.size(-2) > matrix.size(-1) else matrix
    block = block[: SCREEN_BLOCK[0], : SCREEN_BLOCK[1]]
    ieee = block.to(torch.float64 if block.dtype == torch.float64 else torch.float32)
    operands = {loop: ieee.to(torch.bfloat16) if loop == "bf16" else ieee for loop in loops}

    def product_seconds(loop: LoopPrecision) -> float:
        operand = operands[loop]
        with _float32_matmul_precision("high" if loop == "tf32" else "highest"):
            _synchronize(matrix.device)
            before = _timer()
            operand @ operand.mT
            _synchronize(matrix.device)
            return _timer() - before

    for loop in loops:  # warm-up
        product_seconds(loop)
    seconds = dict.fromkeys(loops, float("inf"))
    for _ in range(SCREEN_ROUNDS):
        for loop in loops:
            seconds[loop] = min(seconds[loop], product_seconds(loop))
    return {str(loop): value for loop, value in seconds.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, device.type):
        getattr(torch, device.type).synchronize(device)


def _seconds_text(record: ProbeRecord) -> str:
    times = ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in record.seconds.items())
    return f"{times}; probe {record.probe_seconds * 1e3:.3g} ms"


# ---- disk cache -------------------------------------------------------------------------------


def machine_key(device: torch.device) -> str:
    """The disk cache's outer key: the device's name, the CPU thread count and torch's version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_name() if device.type == "cpu" else device.type
    return f"{name} | {torch.get_num_threads()} threads | torch {torch.__version__}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cache_path() -> Path | None:
    path = os.environ.get(CACHE_ENV)
    return Path(path) if path else None


def _read_cache(path: Path) -> dict[str, dict[str, dict[str, object]]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        warnings.warn(f"{CACHE_ENV}: cannot read {path} ({error}); probing instead", RuntimeWarning, stacklevel=4)
        return {}
    return data if isinstance(data, dict) else {}


def _from_disk(key: ProbeKey) -> ProbeRecord | None:
    path = _cache_path()
    if path is None:
        return None
    entry = _read_cache(path).get(machine_key(torch.device(key.device)), {}).get(key.disk_key())
    if not isinstance(entry, dict) or not isinstance(entry.get("kernel"), str):
        return None
    kernel = str(entry["kernel"])
    if kernel != "auto":
        Kernel.parse(kernel, f"{CACHE_ENV} ({path})")
    seconds = entry.get("seconds")
    return ProbeRecord(key, kernel, "disk cache", dict(seconds) if isinstance(seconds, dict) else {})


def disk_choice(key: ProbeKey) -> str | None:
    """The kernel the disk cache (:data:`CACHE_ENV`) holds for ``key`` on this machine, or ``None``."""
    record = _from_disk(key)
    return None if record is None else record.kernel


def _to_disk(record: ProbeRecord) -> None:
    path = _cache_path()
    if path is None:
        return
    data = _read_cache(path)
    saved = {name: value for name, value in asdict(record).items() if name in ("kernel", "seconds", "runs", "probe_seconds")}
    data.setdefault(machine_key(torch.device(record.key.device)), {})[record.key.disk_key()] = saved
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(temporary, path)  # atomic: a reader sees the old file or the new one
