"""Run by test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU): one scenario per invocation; each rank
writes what happened to <out>/rank<r>.json."""

import json
import sys
from pathlib import Path

import torch.distributed as dist


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from asyncgrpo.distributed import on_main, require_shared_dir

    ran, outcome = [], None
    try:
        if scenario == "main_fails":
            def fail():
                ran.append(rank)
                raise ValueError("the dataset file train.jsonl does not exist")
            on_main(fail, "start-up")
        elif scenario == "main_succeeds":
            outcome = on_main(lambda: ran.append(rank) or "rank-0 result", "start-up")
        elif scenario == "shared_dir":
            require_shared_dir(out / "shared", "output_dir")
        elif scenario == "private_dir":
            require_shared_dir(out / f"private-{rank}", "output_dir")  # as two nodes with node-local disks
        outcome = {"ok": outcome}
    except Exception as exc:  # noqa: BLE001 - reported to the test
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    (out / f"rank{rank}.json").write_text(json.dumps({"ran": ran, **outcome}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
