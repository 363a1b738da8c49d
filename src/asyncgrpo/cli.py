"""`asyncgrpo train | demo | bench`: parse, build, run, clean up."""

from __future__ import annotations

import argparse
import sys

from .errors import AsyncGRPOError


def cmd_train(args, overrides: list[str]) -> int:
    """Run under a launcher (`accelerate launch -m asyncgrpo train ...`) or as a single process."""
    from .config import AsyncGRPOConfig
    from .trainer import AsyncGRPOTrainer

    cfg = AsyncGRPOConfig.load(args.config, overrides)
    trainer = AsyncGRPOTrainer(cfg)
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.cleanup()
    return 0


def cmd_demo(args, overrides: list[str]) -> int:
    from .demo import run_demo

    return run_demo(args, overrides)


def cmd_bench(args, overrides: list[str]) -> int:
    from .bench import run_bench

    return run_bench(args, overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (run it under accelerate launch / torchrun for several ranks)")
    train.add_argument("--config", help="YAML config file; any `--key value` after it overrides a config key")
    demo = sub.add_parser("demo", help="toy world + local vLLM + a 2-process accelerate run, with a summary")
    demo.add_argument("--config", default=None, help="default: configs/demo.yaml")
    demo.add_argument("--num_processes", type=int, default=2)
    demo.add_argument("--port", type=int, default=0, help="vLLM port (0 = a free one)")
    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench.add_argument("name", choices=["policy_equivalence"])
    bench.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    bench.add_argument("--server", default=None, help="use a running vLLM server at this URL instead of starting one")
    args, overrides = parser.parse_known_args(argv)
    handlers = {"train": cmd_train, "demo": cmd_demo, "bench": cmd_bench}
    try:
        return handlers[args.command](args, overrides)
    except AsyncGRPOError as exc:
        print(f"asyncgrpo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
