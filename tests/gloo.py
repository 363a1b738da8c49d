"""Real gloo ranks for the unit tests of collectives: `two_ranks(directory, scenarios)` (rank 0 this process, rank 1
a forked child), `several_ranks(directory, scenarios, world)` (the same with ranks 1..world-1 forked) and
`one_rank(directory)` (a process group of one, in this process); `rank_accelerator` stands in for accelerate's.

Rank 1 is forked from the test process, so it runs the very code under test (mutated or not) and starts in
milliseconds; rank 0's calls are traced in-process by coverage and mutation tools while both ranks run the real
collectives. Importable as `from gloo import two_ranks` (pyproject.toml puts tests/ on pytest's `pythonpath`).
"""

from __future__ import annotations

import datetime
import multiprocessing
import traceback
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

WORLD = 2
COLLECTIVE_TIMEOUT_S = 30  # a rank that skips a collective fails the other one after this, never hangs it

# A scenario runs on both ranks as scenario(rank, *args); what each rank returns goes back to the test.
Scenario = Callable[..., object]


def init_process_group(init_file: Path | str, rank: int, world: int = WORLD) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _serve(init_file: str, scenarios: dict[str, Scenario], conn, rank: int = 1, world: int = WORLD) -> None:
    """Rank `rank` (a forked child): run each (name, args) received on `conn` until None; answer ("ok", result) or
    ("failed", traceback)."""
    init_process_group(init_file, rank, world)
    while (request := conn.recv()) is not None:
        name, args = request
        try:
            conn.send(("ok", scenarios[name](rank, *args)))
        except BaseException:
            conn.send(("failed", f"{name}:\n{traceback.format_exc()}"))
            raise  # the child ends: rank 0, if it waits in a collective, fails at once instead of at the timeout


def two_ranks(directory: Path, scenarios: dict[str, Scenario]) -> AbstractContextManager[Callable[..., tuple]]:
    """Start rank 1 (forked) and join it as rank 0; yield `run(name, *args)`, which runs `scenarios[name](rank, *args)`
    on both ranks and returns (rank 0's result, rank 1's). `args` and rank 1's result cross a pipe: picklable only.

    Start it once per test module (a module-scoped fixture): a rank forked from a process that has already run DTensor
    code inherits its caches and lock state (rank 1 then hung or got rank 0's shapes)."""
    return several_ranks(directory, scenarios, WORLD)


@contextmanager
def several_ranks(directory: Path, scenarios: dict[str, Scenario], world: int) -> Iterator[Callable[..., tuple]]:
    """`two_ranks` with `world` ranks: ranks 1..world-1 forked, and `run` returns every rank's result in rank order."""
    init_file = str(Path(directory) / "init")
    children = []
    for rank in range(1, world):
        mine, theirs = multiprocessing.Pipe()
        child = multiprocessing.get_context("fork").Process(target=_serve,
                                                            args=(init_file, scenarios, theirs, rank, world),
                                                            daemon=True)
        child.start()
        theirs.close()
        children.append((child, mine))
    init_process_group(init_file, 0, world)

    def run(name: str, *args) -> tuple:
        for _, conn in children:
            conn.send((name, args))
        try:
            result = scenarios[name](0, *args)
            answers = []
            for rank, (_, conn) in enumerate(children, 1):
                assert conn.poll(COLLECTIVE_TIMEOUT_S), f"rank {rank} did not finish {name}"
                answers.append(conn.recv())
        except BaseException:
            for child, _ in children:
                child.kill()  # it may wait in a collective rank 0 never reached: fail now, not at the timeout
            raise
        for rank, (status, answer) in enumerate(answers, 1):
            assert status == "ok", f"rank {rank} failed {answer}"
        return (result, *(answer for _, answer in answers))

    try:
        yield run
    finally:
        for child, conn in children:
            if child.is_alive():
                conn.send(None)  # done
        for child, _ in children:
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


def rank_accelerator(rank: int, kind: str, world: int = WORLD, **extra) -> SimpleNamespace:
    """What the trainer's gather and checkpoint code reads of accelerate's Accelerator on rank `rank` of `world`:
    `kind` is ddp, fsdp or deepspeed; `extra` adds fields (is_fsdp2, wait_for_everyone, ...)."""
    from accelerate.utils import DistributedType  # heavy: only the tests that build one need accelerate

    distributed_type = {"ddp": DistributedType.MULTI_CPU, "fsdp": DistributedType.FSDP,
                        "deepspeed": DistributedType.DEEPSPEED}[kind]
    return SimpleNamespace(is_main_process=rank == 0, process_index=rank, num_processes=world,
                           distributed_type=distributed_type, unwrap_model=lambda m: getattr(m, "module", m), **extra)
