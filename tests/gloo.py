"""Two real gloo ranks for the unit tests of collectives: `two_ranks(directory, scenarios)` (rank 0 this process, rank 1
a forked child) and `one_rank(directory)` (a process group of one, in this process).

Rank 1 is forked from the test process, so it runs the very code under test (mutated or not) and starts in
milliseconds; rank 0's calls are traced in-process by coverage and mutation tools while both ranks run the real
collectives. Importable as `from gloo import two_ranks` (pyproject.toml puts tests/ on pytest's `pythonpath`).
"""

from __future__ import annotations

import datetime
import multiprocessing
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

WORLD = 2
COLLECTIVE_TIMEOUT_S = 30  # a rank that skips a collective fails the other one after this, never hangs it

# A scenario runs on both ranks as scenario(rank, *args); what each rank returns goes back to the test.
Scenario = Callable[..., object]


def init_process_group(init_file: Path | str, rank: int, world: int = WORLD) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _serve(init_file: str, scenarios: dict[str, Scenario], conn) -> None:
    """Rank 1: run each (name, args) received on `conn` until None; answer ("ok", result) or ("failed", traceback)."""
    init_process_group(init_file, 1)
    while (request := conn.recv()) is not None:
        name, args = request
        try:
            conn.send(("ok", scenarios[name](1, *args)))
        except BaseException:
            conn.send(("failed", f"{name}:\n{traceback.format_exc()}"))
            raise  # the child ends: rank 0, if it waits in a collective, fails at once instead of at the timeout


@contextmanager
def two_ranks(directory: Path, scenarios: dict[str, Scenario]) -> Iterator[Callable[..., tuple]]:
    """Start rank 1 (forked) and join it as rank 0; yield `run(name, *args)`, which runs `scenarios[name](rank, *args)`
    on both ranks and returns (rank 0's result, rank 1's). `args` and rank 1's result cross a pipe: picklable only.

    Start it once per test module (a module-scoped fixture): a rank forked from a process that has already run DTensor
    code inherits its caches and lock state (rank 1 then hung or got rank 0's shapes)."""
    init_file = str(Path(directory) / "init")
    mine, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("fork").Process(target=_serve, args=(init_file, scenarios, theirs),
                                                        daemon=True)
    child.start()
    theirs.close()
    init_process_group(init_file, 0)

    def run(name: str, *args) -> tuple:
        mine.send((name, args))
        try:
            result = scenarios[name](0, *args)
            assert mine.poll(COLLECTIVE_TIMEOUT_S), f"rank 1 did not finish {name}"
            status, answer = mine.recv()
        except BaseException:
            child.kill()  # it may wait in a collective rank 0 never reached: fail now, not at the timeout
            raise
        assert status == "ok", f"rank 1 failed {answer}"
        return result, answer

    try:
        yield run
    finally:
        if child.is_alive():
            mine.send(None)  # done
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
        dist.destroy_process_group()


@contextmanager
def one_rank(directory: Path) -> Iterator[None]:
    """A gloo process group of one rank (this process) while the block runs."""
    init_process_group(Path(directory) / "init", 0, world=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
