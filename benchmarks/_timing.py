"""Side-by-side timing shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RoundRobinTimes:
    """Seconds per candidate: its first call, apart, and the timed calls after it."""

    first: dict[str, float]
    samples: dict[str, list[float]]
    """One time per repeat, in repeat order (so ``samples[a][r] / samples[b][r]`` is a ratio within repeat ``r``)."""

    @property
    def median(self) -> dict[str, float]:
        return {name: statistics.median(times) for name, times in self.samples.items()}

    def median_ratio(self, name: str, baseline: str) -> float:
        """The median over repeats of ``name``'s time over ``baseline``'s in the same repeat: load
        that drifts between repeats cancels, which it does not in a ratio of the two medians."""
        return statistics.median(t / b for t, b in zip(self.samples[name], self.samples[baseline], strict=True))


def round_robin(
    steps: Mapping[str, Callable[[], object]],
    repeats: int,
    *,
    before: Callable[[str, int], object] | None = None,
    rotate: bool = False,
) -> RoundRobinTimes:
    """Time each step's first call, then call the steps in turn within every repeat.

    Taking turns makes machine-load drift hit every candidate alike, so ratios between them
    hold even on a shared machine. The first call (lazy state, compiles, probes) is reported
    apart and kept out of the median. ``before(name, repeat)``, when given, runs untimed before
    every call (``repeat`` is -1 for the first call): e.g. to write fresh gradients. ``rotate``
    starts repeat ``r`` at the ``r``-th candidate, so none always runs right after another.
    """
    first: dict[str, float] = {}
    for name, step in steps.items():
        if before is not None:
            before(name, -1)
        started = time.perf_counter()
        step()
        first[name] = time.perf_counter() - started
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for repeat in range(repeats):
        start = repeat % len(names) if rotate and names else 0
        for name in names[start:] + names[:start]:
            step = steps[name]
            if before is not None:
                before(name, repeat)
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return RoundRobinTimes(first, times)


def round_robin_medians(steps: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each step, calling them in turn within every repeat
    (:func:`round_robin`; each step runs once first, untimed). An even count takes the upper
    middle one, as this function always has."""
    return {name: sorted(t)[len(t) // 2] for name, t in round_robin(steps, repeats).samples.items()}
