"""`asyncgrpo train | check | doctor | demo | bench | rollout-serve`: parse, build, run, clean up.

Subcommands whose modules import torch import them only when chosen, so that `asyncgrpo --help` answers at
once. Every `AsyncGRPOError` ends as one `asyncgrpo: error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap

from asyncgrpo.bench import run_bench
from asyncgrpo.bench.modes import parse_modes
from asyncgrpo.check import run_check
from asyncgrpo.config import AsyncGRPOConfig, read_values, reference, trl_notice
from asyncgrpo.demo import run_demo
from asyncgrpo.demo_agent import run_agent_demo
from asyncgrpo.errors import AsyncGRPOError, ConfigError, PeerFailed
from asyncgrpo.shutdown import exit_on_signal
from asyncgrpo.trl_compat import apply_environment, trl_name


def cmd_train(args, overrides: list[str]) -> int:
    """Run under a launcher (`accelerate launch -m asyncgrpo train ...`) or as a single process: the Python API's
    trainer (api.py) with the config alone."""
    from asyncgrpo.api import AsyncGRPOTrainer
    # heavy: distributed imports torch, which `asyncgrpo --help` and the other commands do not need
    from asyncgrpo.distributed import leave_launched_process

    values = read_values(args.config, overrides)
    cfg = AsyncGRPOConfig.from_dict(values)
    apply_environment(values)  # TRL's `env:` mapping, before anything of the run reads the environment
    notice = trl_notice(values)
    if notice and os.environ.get("RANK", "0") == "0":  # once per run: every rank reads the same file
        print(f"asyncgrpo: {notice}", file=sys.stderr, flush=True)
    AsyncGRPOTrainer(args=cfg).train()  # signals: no server left paused, a checkpoint on SIGTERM (api.py)
    leave_launched_process(0)  # a finished rank of a launch skips interpreter finalization (distributed.py says why)
    return 0


def cmd_check(args, overrides: list[str]) -> int:
    return run_check(args.config, overrides)


def cmd_demo(args, overrides: list[str]) -> int:
    if args.world == "agent":
        if args.server:
            raise AsyncGRPOError("`asyncgrpo demo --world agent` starts its own server; --server is for the toy "
                                 "world only. Fix: drop --server, or drop --world agent")
        return run_agent_demo(args, overrides)
    return run_demo(args, overrides)


def cmd_doctor(args, overrides: list[str]) -> int:
    from asyncgrpo.rollout.preflight import run_doctor  # heavy: the rollout side imports torch, not needed by --help

    return run_doctor(args, overrides)


def _ints(text: str) -> tuple[int, ...]:
    """`0,2,4` -> (0, 2, 4)."""
    return tuple(int(v) for v in text.split(","))


def _modes(text: str) -> tuple[str, ...]:
    """`batch,stream+inflight` -> ("batch", "stream+inflight"); argparse reports an unknown name with the choices."""
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def cmd_bench(args, overrides: list[str]) -> int:
    return run_bench(args, overrides)


# The paths a rollout host resolves itself (`rollout-serve --KEY VALUE`); every other setting is the trainer's config.
ROLLOUT_SERVE_PATHS = {
    "model_path": "the base model's local directory here (its tokenizer is loaded from it; default: rank 0's)",
    "dataset_name": "the prompt source here: a data file or saved dataset directory (default: the trainer's)",
    "data_files": "local data files here, for dataset_name json | parquet | csv | arrow (default: the trainer's)",
    "lora_adapter_path": "where this host writes adapter versions (the inference servers read them here with "
                         "adapter_delivery: shared_fs; default: the trainer's)",
    "output_dir": "where this host writes its TensorBoard logs, <output_dir>/tensorboard (default: the trainer's)",
}


def cmd_rollout_serve(args, overrides: list[str]) -> int:
    """Serve one trainer's rollout side (`rollout_address`), then exit: 0 after its close, 1 if it went away."""
    if overrides:
        raise ConfigError("rollout-serve", f"unknown arguments {' '.join(overrides)}", "give --listen and, where "
                          f"this host's paths differ, --{' / --'.join(ROLLOUT_SERVE_PATHS)}; every other setting "
                          "comes from the trainer's config")
    from asyncgrpo.transport.rollout_server import serve_one_run  # heavy: torch (the rollout side), not needed by --help

    paths = {name: getattr(args, name) for name in ROLLOUT_SERVE_PATHS if getattr(args, name) is not None}
    return serve_one_run(args.listen, paths)


def config_keys_help() -> str:
    """Every config key with its type, default, whole doc (the source of docs/configuration.md) and TRL name, for
    `asyncgrpo train --help`."""
    lines = ["config keys (YAML `key: value`, or `--key value` after --config; TRL's names are read too, "
             "docs/configuration.md#trl-keys):"]
    for name, kind, default, doc in reference():
        lines.append(f"  --{name} {kind} (default: {default})")
        lines += textwrap.wrap(f"{doc} TRL: {trl_name(name)}.", width=116, initial_indent=" " * 6,
                               subsequent_indent=" " * 6, break_on_hyphens=False)
    return "\n".join(lines)


def cmd_keygen(args, overrides) -> int:
    """A new rollout link key on stdout (transport/link.py: generate_key), nothing else."""
    from asyncgrpo.transport.link import generate_key  # the standard library only: no torch for a key

    if overrides:
        raise ConfigError("keygen", f"takes no arguments, got {' '.join(overrides)}", "run `asyncgrpo keygen` alone")
    print(generate_key())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncgrpo", description=__doc__.split("\n\n")[0])
    # The `deepspeed` launcher puts --local_rank=N before the subcommand; each rank reads LOCAL_RANK instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (run it under accelerate launch / torchrun for several ranks)",
                           epilog=config_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("--config", help="YAML config file; any `--key value` after it overrides a config key")
    check = sub.add_parser("check", help="validate a config without training: every problem at once, or the "
                                         "resolved config (exit status 0 when valid)",
                           epilog="Overrides as for train (`asyncgrpo train --help` lists every key).")
    check.add_argument("--config", help="YAML config file; any `--key value` after it overrides a config key")
    demo = sub.add_parser("demo", help="toy world + local vLLM + a 2-process accelerate run, with a summary")
    demo.add_argument("--config", default=None, help="default: configs/demo.yaml")
    demo.add_argument("--num_processes", type=int, default=2)
    demo.add_argument("--port", type=int, default=0, help="vLLM port (0 = a free one)")
    demo.add_argument("--server", default=None,
                      help="train against the inference node already serving the toy model at this URL (e.g. a "
                           "container: scripts/container_check.sh) instead of starting a local vLLM server")
    demo.add_argument("--world", default="toy", choices=["toy", "agent"],
                      help="toy: which of two numbers is larger (one turn); agent: answer through a lookup tool "
                           "over several turns (--config is then not read; `--key value` overrides still apply)")
    demo.add_argument("--agent-endpoint", "--agent_endpoint", dest="agent_endpoint", action="store_true",
                      help="with --world agent: run the toy agent as an openai-client function through the agent "
                           "endpoint (agent_function) instead of the built-in episode loop")
    doctor = sub.add_parser("doctor", help="check the inference server(s) and adapter directory against a config")
    doctor.add_argument("--config", help="YAML config file; `--key value` after it overrides a config key")
    bench = sub.add_parser("bench", help="benchmarks that print JSON")
    bench.add_argument("name", choices=["agent", "chaos", "memory", "policy_equivalence", "producer", "rank0",
                                        "staleness", "sync", "throughput"])
    bench.add_argument("--json", action="store_true", help="print one JSON object (the default output)")
    bench.add_argument("--server", default=None, help="use a running vLLM server at this URL instead of starting "
                                                      "one (sync: several URLs joined by commas)")
    bench.add_argument("--backend", default="fsdp2", choices=["ddp", "fsdp1", "fsdp2", "zero2", "zero3", "all"],
                       help="sync: the sharding backend to launch (2 CPU ranks, launch/accelerate/<backend>_cpu.yaml)")
    bench.add_argument("--servers", type=int, default=1,
                       help="sync: start this many local vLLM CPU servers (~2.5 GiB each) and sync all of them")
    bench.add_argument("--model", default=None,
                       help="sync: model directory (or shape:NAME) to use instead of the built-in hidden-512, 4-layer "
                            "bench model; memory: measure this model (e.g. shape:qwen2.5-1.5b) per rank under "
                            "--backend, 2 CPU ranks")
    bench.add_argument("--skip_naive", action="store_true",
                       help="sync: do not time the whole-model gather beside the LoRA-only one (it holds a second "
                            "copy of the base on rank 0, on every rank under FSDP1: too much for a large model on a "
                            "small host)")
    bench.add_argument("--plot", default=None, metavar="FILE.png",
                       help="throughput: draw the trainer/server busy timelines of each run into this PNG; "
                            "staleness: held-out reward against max_staleness per correction")
    bench.add_argument("--duration", type=float, default=5.0,
                       help="producer: seconds of each timed run (after a 1 s warm-up)")
    bench.add_argument("--vocab_size", type=int, default=151936, help="memory: vocabulary of the random model")
    bench.add_argument("--completion_tokens", type=int, default=None,
                       help="memory: completion tokens in the step (default 1024); with --model: per completion "
                            "(default 512)")
    bench.add_argument("--completions", type=int, default=8, help="memory with --model: completions in the step")
    bench.add_argument("--variants", type=lambda t: tuple(t.split(",")), default=("default",),
                       help="memory with --model: default (gradient checkpointing, chunked head), "
                            "no_checkpointing, no_chunking; comma-separated")
    bench.add_argument("--num_iterations", type=int, default=None,
                       help="staleness, agent: optimizer steps per batch (staleness: 1 by default; agent: see "
                            "docs/benchmarks.md)")
    bench.add_argument("--grid", type=_ints, default=None,
                       help="staleness, agent: max_staleness values, e.g. 0,2,4 (agent: 0,1,2 by default)")
    bench.add_argument("--staleness", type=_ints, default=None,
                       help="throughput, agent: max_staleness values, e.g. 0,1,2 (the default)")
    bench.add_argument("--modes", type=_modes, default=None,
                       help="throughput, agent: rollout modes, comma-separated, of batch, stream, stream+inflight "
                            "(batch alone by default)")
    bench.add_argument("--compare_versions", action="store_true",
                       help="agent: also run `episode_version: latest` at each max_staleness above 0")
    bench.add_argument("--overhead_only", action="store_true",
                       help="agent: only measure the agent endpoint's overhead per turn against the built-in loop")
    bench.add_argument("--tool_latency", type=float, default=None,
                       help="agent: seconds each simulated tool call sleeps (0.05 by default)")
    bench.add_argument("--seeds", type=_ints, default=None, help="staleness: seeds, e.g. 0,1,2")
    bench.add_argument("--corrections", type=lambda t: tuple(t.split(",")), default=None,
                       help="staleness: e.g. none,default,token_truncate (none: delta null, no correction)")
    bench.add_argument("--steps", type=int, default=500, help="chaos: optimizer steps of the run under faults")
    bench.add_argument("--seed", type=int, default=None,
                       help="chaos: seeds the fault plan and the run (default 0); other benches: the config key")
    bench.add_argument("--faults", type=int, default=None,
                       help="chaos: faults injected (default: steps // 50, at least one of each kind)")
    bench.add_argument("--kinds", type=lambda t: tuple(t.split(",")), default=None,
                       help="chaos: fault kinds, from server,receiver,rollout,rank,malformed (default: all)")
    bench.add_argument("--save_steps", type=int, default=None,
                       help="chaos: checkpoint every N steps (default: steps // 5, at most 25); other benches: the "
                            "config key")
    bench.add_argument("--workdir", default=None,
                       help="chaos: directory of the run, the server's and receiver's logs (default runs/bench-chaos; "
                            "emptied first)")
    bench.add_argument("--rollout_side", choices=["child", "serve"], default="child",
                       help="chaos: the run's rollout side as rank 0's child process, or as `asyncgrpo rollout-serve` "
                            "reached over loopback TCP (`rollout_address`, as on another host)")
    bench.add_argument("--baseline", action="store_true",
                       help="chaos: also train an undisturbed run of the same steps and seed for its held-out reward")
    serve = sub.add_parser("rollout-serve", help="run the rollout side for one trainer run, which connects to it "
                                                 "(`rollout_address`), e.g. on another host (docs/running.md)")
    serve.add_argument("--listen", required=True, metavar="HOST:PORT",
                       help="address to listen on (port 0: a free one; the address is logged). Needs the key in "
                            "ASYNCGRPO_ROLLOUT_KEY (made by `asyncgrpo keygen`), the same on the trainer's host")
    for name, text in ROLLOUT_SERVE_PATHS.items():
        serve.add_argument(f"--{name}", nargs="+" if name == "data_files" else None, default=None, help=text)
    sub.add_parser("keygen", help="print a new key for ASYNCGRPO_ROLLOUT_KEY (256 random bits and a checksum): "
                                  "export ASYNCGRPO_ROLLOUT_KEY=$(asyncgrpo keygen)")
    args, overrides = parser.parse_known_args(argv)
    handlers = {"keygen": cmd_keygen, "train": cmd_train, "check": cmd_check, "demo": cmd_demo, "bench": cmd_bench, "doctor": cmd_doctor,
                "rollout-serve": cmd_rollout_serve}
    # train and rollout-serve handle signals themselves (resume paused servers first); for the others a signal exits
    # through their `finally` blocks, which stop the vLLM servers and launches they started (children.py).
    on_signal = contextlib.nullcontext() if args.command in ("train", "rollout-serve") else exit_on_signal(lambda: None)
    try:
        with on_signal:
            return handlers[args.command](args, overrides)
    except PeerFailed:
        return 2  # rank 0 failed first and printed the error; this rank stops quietly with the same code
    except AsyncGRPOError as exc:
        # A config error is the same on every rank of a launch: only global rank 0 prints it (a launcher still adds
        # its own summary of the failed workers; see docs/faults.md). Other errors can be rank-specific.
        if not isinstance(exc, ConfigError) or os.environ.get("RANK", "0") == "0":
            print(f"asyncgrpo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
