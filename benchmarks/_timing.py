"""Side-by-side timing shared by the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping


def round_robin_medians(steps: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each step, calling them in turn within every repeat.

    Taking turns makes machine-load drift hit every candidate alike, so ratios between them
    hold even on a shared machine. Each step runs once first, untimed (lazy state, compiles).
    """
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}
