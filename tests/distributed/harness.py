"""Run a function in N real processes (gloo on CPU) and collect what each rank returns.

Each rank is a fresh ``spawn``ed interpreter joined through a file store; it runs
``fn(rank, world_size, *args)`` and its return value (or its traceback) comes back through a file.
A rank that fails or a run that exceeds ``timeout`` fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    torch.set_num_threads(1)  # N ranks share this machine's 2 cores
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        torch.save({"ok": result}, result_path)
    except BaseException:  # noqa: BLE001 - the parent reports it
        torch.save({"error": traceback.format_exc()}, result_path)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run this process with one thread, as each rank does: matmuls split their sums by thread,
    so a reference with more threads differs from the ranks in the last bit (and on 2 busy
    cores, OpenMP's spin-waiting makes tiny steps ~50x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 180.0) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, ...)]``, each run on its own rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    """
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        processes = [
            context.Process(target=_entry, args=(rank, world_size, store, tmp, fn, args), daemon=True)
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        for process in processes:
            process.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
        outcomes = []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pt"
            outcomes.append(torch.load(path, weights_only=False) if path.exists() else None)
    errors = [f"rank {rank}:\n{o['error']}" for rank, o in enumerate(outcomes) if o is not None and "error" in o]
    if errors:
        raise AssertionError("\n".join(errors))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout:.0f} s (a collective hung?)")
    missing = [rank for rank, o in enumerate(outcomes) if o is None]
    if missing:
        raise AssertionError(f"ranks {missing} exited without a result")
    return [o["ok"] for o in outcomes]
