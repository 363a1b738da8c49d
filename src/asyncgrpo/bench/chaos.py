"""`asyncgrpo bench chaos --json [--steps 500] [--seed 0] [--faults N] [--kinds server,receiver,...] [--baseline]
[--rollout_side child|serve]`: does a long run survive its parts dying?

The toy world on a real vLLM CPU server, an adapter receiver (`adapter_delivery: http`) and a 2-rank gloo launch with
its rollout side in a child process (`rollout_process: true`) or, with `--rollout_side serve`, in `asyncgrpo
rollout-serve` reached over loopback TCP (`rollout_address`, as on another host), `max_staleness: 1`, checkpoints
every `save_steps`.
At seeded random steps it kills and restarts the server or the receiver, kills the rollout process or a training
rank, or sends malformed requests to every port the run's processes listen on. A run that ends is resumed from its
latest checkpoint, to the step count. What it measures and the goal: docs/faults.md ("Soak and chaos").
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import secrets
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from asyncgrpo.bench.chaos_cast import (Launch, Receiver, RolloutServe, Segment, Server, listening_ports,
                                        malformed_requests, rss, run_environment, send_raw, tree)
from asyncgrpo.bench.policy_equivalence import served_vs_exported
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import load_prompts, toy_world
from asyncgrpo.demo import default_config_path, heldout_rewards
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.transport.link import generate_key

KINDS = ("server", "receiver", "rollout", "rank", "malformed")
SURVIVABLE = ("server", "receiver", "malformed")  # the trainer is built to ride these out; the others end the run
SURVIVE_STEPS = 2  # a fault is survived once the same run has trained this many more steps after it
MEMORY_EVERY = 10  # steps trained between resident-memory samples
WARM_STEPS = 10  # a (re)started process's first steps are its warm-up: memory growth is measured after them
GROWTH_SPAN = 50  # steps a process must live through (after warm-up) for its growth per 100 steps to be measured
POLL_S = 0.25
DEFAULT_WORKDIR = "runs/bench-chaos"
OWN_PATHS = ("run", "run-adapters", "baseline", "baseline-adapters", "receiver")  # under the workdir
# On top of configs/demo.yaml: what the bench is about. vllm_server_timeout: the outage budget; a vLLM CPU restart
# takes ~30 s on a quiet machine and over 5 min on a loaded one. ddp_timeout: the check's bound with http delivery
# (a sync through a server outage, two deliveries and a receiver outage) is ~4,900 s at that budget.
WORKLOAD = ["--max_staleness", "1", "--weight_sync_steps", "1",
            "--adapter_delivery", "http", "--vllm_server_timeout", "900", "--ddp_timeout", "5400"]
ROLLOUT_SIDES = ("child", "serve")
ERROR_LINE = re.compile(r"^(asyncgrpo: error: .*|.*exitcode\s*:\s*-?\d+.*|.*Signal \d+ \(\w+\) received by PID.*)$",
                        re.MULTILINE)


def plan(steps: int, count: int, kinds: tuple[str, ...], seed: int, first_step: int) -> list[dict]:
    """`count` faults at distinct seeded steps in [first_step, steps - 2], every kind of `kinds` at least once when
    count allows, each with a delay of 0-1 s after its step is reached (a moment inside the step, not its start)."""
    rng = random.Random(seed)
    lo, hi = min(first_step, steps - 2), steps - 2
    at = sorted(rng.sample(range(max(lo, 1), hi + 1), min(count, hi - max(lo, 1) + 1)))
    chosen = [*rng.sample(kinds, len(kinds)), *(rng.choice(kinds) for _ in range(max(0, len(at) - len(kinds))))]
    chosen = chosen[:len(at)]
    rng.shuffle(chosen)
    return [{"kind": k, "step": s, "delay_s": round(rng.uniform(0, 1), 3)} for k, s in zip(chosen, at)]


class Chaos:
    """Drives one run through its plan: polls its step, injects each fault when its step comes, judges whether it was
    survived, resumes a run that ended, samples memory."""

    def __init__(self, *, server: Server, receiver: Receiver, launch: Launch, output_dir: Path, steps: int,
                 faults: list[dict], seed: int, rollout_serve: RolloutServe | None = None):
        self.server, self.receiver, self.launch, self.output_dir = server, receiver, launch, output_dir
        self.rollout_serve = rollout_serve  # None: the rollout side is rank 0's child process
        self.steps, self.pending, self.rng = steps, list(faults), random.Random(seed + 1)
        self.records: list[dict] = []
        self.segments: list[dict] = []
        self.samples: list[dict] = []  # {"trained", "step", "role", "pids", "rss"}
        self.trained = 0  # steps trained in all, redone ones included: the axis memory growth is measured on
        self.seen: dict[int, str] = {}  # every pid the run's processes had, for the nothing-left-running check

    # ---- the loop ----

    def drive(self) -> dict | None:
        """Run to `steps`, resuming as needed; returns the final run_summary.json (None if the run could not go on)."""
        segment = self._start(resume=False)
        step, next_sample, sampled_at = 0, MEMORY_EVERY, -1
        while True:
            code = segment.group.process.poll()
            now = self.launch.step(segment)
            if now > step:
                self.trained += now - step
                step = now
            self._judge(segment, step)
            last_chance = step >= self.steps - 1 and code is None and step != sampled_at  # before the run exits
            if self.trained >= next_sample or last_chance:
                self._sample(segment, step)
                next_sample, sampled_at = self.trained + MEMORY_EVERY, step
            if code is not None:
                summary = self._ended(segment, code, step)
                if code == 0:
                    return summary
                if len(self.launch.segments) > len(self.records) + 2:
                    return None  # ending again and again without faults: give up rather than loop
                # The resumed run starts at its checkpoint's step (its first version is that step's adapter); one that
                # ended before its first checkpoint (a launch that failed to start) starts again from scratch.
                resume = self.latest_checkpoint()
                segment, step = self._start(resume=resume is not None), resume or 0
                continue
            if self.pending and step >= self.pending[0]["step"] and step < self.steps and not self.ending(segment):
                self._inject(self.pending.pop(0), segment, step)
            time.sleep(POLL_S)

    def ending(self, segment: Segment) -> bool:
        """Whether a fault that ends the run already hit `segment`: its launch may still be going down (the other
        rank, the launcher) and even finish a step meanwhile, so the next fault waits for the resumed run instead of
        landing on one that is already lost and being counted as ended with it."""
        return any(r["segment"] == segment.index and r["kind"] not in SURVIVABLE
                   and r.get("rank", r.get("pid")) is not None for r in self.records)

    def _start(self, resume: bool) -> Segment:
        """A launch (resumed or not), with a new rollout-serve first when the rollout side is served (one per run)."""
        if self.rollout_serve is not None:
            self.rollout_serve.start()
            for p in tree(self.rollout_serve.pid()):
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(p.pid, " ".join(p.cmdline())[:200])
        return self.launch.start(resume=resume)

    def _rollout_pid(self, segment: Segment) -> int | None:
        return segment.rollout_pid() if self.rollout_serve is None else self.rollout_serve.pid()

    def _judge(self, segment: Segment, step: int) -> None:
        for r in self.records:
            if r["outcome"] == "pending" and r["segment"] == segment.index and step >= r["step_after"] + SURVIVE_STEPS:
                r["outcome"] = "survived"

    def latest_checkpoint(self) -> int | None:
        steps = [int(p.name.split("-")[1]) for p in self.output_dir.glob("checkpoint-*")
                 if p.name.split("-")[1].isdigit() and (p / "manifest.json").exists()]
        return max(steps) if steps else None

    def _ended(self, segment: Segment, code: int, step: int) -> dict | None:
        segment.group.stop()
        if self.rollout_serve is not None:
            self.rollout_serve.stop()  # it exits after its run's close, or once its trainer is gone
        text = segment.log_path.read_text(errors="replace")
        record = {"segment": segment.index, "exit_code": code, "reached_step": step,
                  "seconds": round(time.monotonic() - segment.started, 1)}
        summary = None
        if code == 0:
            summary = json.loads((self.output_dir / "run_summary.json").read_text())
            record["start_step"] = summary["start_step"]
            for r in self.records:
                if r["outcome"] == "pending" and r["segment"] == segment.index:
                    r["outcome"] = "survived"  # the run went on to its last step
        else:
            checkpoint = self.latest_checkpoint()
            errors = ERROR_LINE.findall(text)[:4]
            if not errors:  # no error line: the run ended without saying why (counts against the goal)
                record["log_tail"] = text.splitlines()[-5:]
            record.update(errors=errors, checkpoint_step=checkpoint,
                          steps_redone=step - checkpoint if checkpoint is not None else step)
            for r in self.records:
                if r["outcome"] == "pending" and r["segment"] == segment.index:
                    r["outcome"] = "ended_run" if checkpoint is not None else "ended_run_no_checkpoint"
        self.segments.append(record)
        return summary

    # ---- faults ----

    def _inject(self, fault: dict, segment: Segment, step: int) -> None:
        time.sleep(fault["delay_s"])
        record = {**fault, "segment": segment.index, "at_step": step, "outcome": "pending"}
        t0 = time.monotonic()
        kind = fault["kind"]
        if kind == "server":
            self.server.kill()
            record["restart_s"] = round(self.server.start(), 1)
        elif kind == "receiver":
            self.receiver.kill()
            self.receiver.start()
        elif kind == "rollout":
            pid = self._rollout_pid(segment)
            record["pid"] = pid
            if self.rollout_serve is not None:
                self.rollout_serve.kill()
            else:
                with contextlib.suppress(ProcessLookupError, TypeError, psutil.NoSuchProcess):
                    psutil.Process(pid).send_signal(signal.SIGKILL)
        elif kind == "rank":
            ranks = segment.ranks()
            rank = self.rng.choice(sorted(ranks)) if ranks else None
            record.update(rank=rank)
            if rank is not None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    ranks[rank].send_signal(signal.SIGKILL)
        elif kind == "malformed":
            record["answers"] = self._malformed(segment)
        record["seconds"] = round(time.monotonic() - t0, 2)
        record["step_after"] = self.launch.step(segment)
        self.records.append(record)
        print(f"[bench chaos] step {step}: {kind} ({record['seconds']} s)", file=sys.stderr, flush=True)

    def _owners(self, segment: Segment) -> dict[str, list[psutil.Process]]:
        owners = {"vllm_server": tree(self.server.vllm.process.pid), "receiver": tree(self.receiver.group.pid),
                  "training_launch": tree(segment.group.pid)}
        if self.rollout_serve is not None and (pid := self.rollout_serve.pid()) is not None:
            owners["rollout_serve"] = tree(pid)
        return owners

    def _malformed(self, segment: Segment) -> dict:
        """Every kind of malformed request to every listening port of the run's processes; their answers, and
        whether every process that listened is still there afterwards."""
        owners = self._owners(segment)
        listening = listening_ports(owners)
        payloads = malformed_requests(self.rng)
        targets = [(port, role, name) for port, (role, _) in sorted(listening.items()) for name in payloads]
        # at once: a port that takes the bytes and never answers (vLLM's internal ones) costs PROBE_TIMEOUT_S each
        with ThreadPoolExecutor(max_workers=32) as pool:
            replies = list(pool.map(lambda t: send_raw(t[0], payloads[t[2]]), targets))
        answers: dict = {}
        for (port, role, name), reply in zip(targets, replies):
            answers.setdefault(f"{role}:{port}", {})[name] = reply
        # The processes that listened must all be there still (others of the trees come and go on their own), the
        # launch's unless it ended meanwhile: a run that finishes during the probe exits; one that fails is judged
        # by its exit code like any other.
        ended = segment.group.process.poll() is not None
        gone = sorted({pid for role, pid in listening.values()
                       if not (ended and role == "training_launch") and not psutil.pid_exists(pid)})
        return {"ports": answers, "processes_gone_after": gone}

    # ---- memory ----

    def _sample(self, segment: Segment, step: int) -> None:
        server = tree(self.server.vllm.process.pid)
        roles = {"vllm_server": server, "receiver": tree(self.receiver.group.pid)}
        for p in server:  # and each of its processes apart (API server, engine core, worker): which one grows
            with contextlib.suppress(psutil.Error):
                roles.setdefault(f"vllm_server/{p.name()}", [p])
        for rank, proc in sorted(segment.ranks().items()):
            roles[f"trainer_rank{rank}"] = [proc]
        if (pid := self._rollout_pid(segment)) is not None:
            roles["rollout_process"] = tree(pid)
        for p in tree(segment.group.pid):
            with contextlib.suppress(psutil.Error):
                self.seen.setdefault(p.pid, " ".join(p.cmdline())[:200])
        for role, procs in roles.items():
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    self.seen.setdefault(p.pid, " ".join(p.cmdline())[:200])
            if procs:
                self.samples.append({"trained": self.trained, "step": step, "role": role,
                                     "pids": sorted(p.pid for p in procs)[:1], "rss": rss(procs)})

    def memory(self) -> dict:
        """Per role: resident MiB at step 100 and at the end, and the growth per 100 steps over the longest stretch a
        process lived through (its first WARM_STEPS steps left out), if any lasted GROWTH_SPAN steps."""
        out = {}
        for role in dict.fromkeys(s["role"] for s in self.samples):
            mine = [s for s in self.samples if s["role"] == role]
            at_100 = next((s for s in mine if s["step"] >= 100), None)
            best = None
            for pid in dict.fromkeys(s["pids"][0] for s in mine):
                life = [s for s in mine if s["pids"][0] == pid]
                warm = [s for s in life if s["trained"] >= life[0]["trained"] + WARM_STEPS]
                if len(warm) >= 2 and warm[-1]["trained"] - warm[0]["trained"] >= GROWTH_SPAN:
                    span = warm[-1]["trained"] - warm[0]["trained"]
                    if best is None or span > best["steps"]:
                        pct = (warm[-1]["rss"] - warm[0]["rss"]) / warm[0]["rss"] * 100 * 100 / span
                        best = {"steps": span, "from_mib": _mib(warm[0]["rss"]), "to_mib": _mib(warm[-1]["rss"]),
                                "pct_per_100_steps": round(pct, 3)}
            out[role] = {"mib_at_step_100": _mib(at_100["rss"]) if at_100 else None,
                         "mib_at_end": _mib(mine[-1]["rss"]), "end_step": mine[-1]["step"],
                         "processes": len({s["pids"][0] for s in mine}), "growth": best}
        return out


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def lost_and_resent(tensorboard: Path) -> tuple[int, int]:
    """Groups lost and sent again, summed over the run's processes (each writes an event file of its own and counts
    from zero)."""
    # heavy: tensorboard, only to read a finished run's event files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lost = resent = 0
    for events in sorted(tensorboard.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags().get("scalars", [])
        for tag, add in (("rollout/lost_groups_total", "lost"), ("rollout/resent_groups_total", "resent")):
            if tag in tags:
                top = int(max(e.value for e in acc.Scalars(tag)))
                lost, resent = (lost + top, resent) if add == "lost" else (lost, resent + top)
    return lost, resent


def by_kind(records: list[dict]) -> dict:
    out = {}
    for r in records:
        row = out.setdefault(r["kind"], {"injected": 0, "survived": 0, "ended_run_resumed": 0, "not_handled": 0})
        row["injected"] += 1
        if r["outcome"] == "survived":
            row["survived"] += 1
        elif r["outcome"] == "ended_run":
            row["ended_run_resumed"] += 1
        else:
            row["not_handled"] += 1
    return out


def _run_args(work: Path, name: str, server: Server, receiver: Receiver, steps: int, seed: int, save_steps: int,
              overrides: list[str], rollout_address: str | None = None) -> list[str]:
    side = ["--rollout_address", rollout_address] if rollout_address else ["--rollout_process", "true"]
    return [*WORKLOAD, *side, "--max_steps", str(steps), "--seed", str(seed), "--save_steps", str(save_steps),
            "--output_dir", str(work / name), "--lora_adapter_path", str(work / f"{name}-adapters"),
            "--vllm_server_base_url", server.url, "--adapter_receiver_url", receiver.url, *overrides]


def left_running(pids: dict[int, str], timeout_s: float = 60.0) -> dict[int, str]:
    """Those of `pids` still running (zombies count as gone) after up to `timeout_s`."""
    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (left := {p: c for p, c in pids.items() if alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def run(overrides: list[str], steps: int = 500, seed: int = 0, faults: int | None = None,
        kinds: tuple[str, ...] = KINDS, baseline: bool = False, save_steps: int | None = None,
        workdir: str | None = None, rollout_side: str = "child") -> dict:
    """Build the toy world, start the server and the receiver, run the plan, measure; `baseline` also trains an
    undisturbed run of the same steps and seed against the same server for its held-out reward (its rollout side a
    child process either way). `rollout_side`: `child` (rank 0's child process) or `serve` (`rollout-serve`)."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    if rollout_side not in ROLLOUT_SIDES:
        raise ValueError(f"unknown rollout side {rollout_side!r}; choose from {', '.join(ROLLOUT_SIDES)}")
    save_steps = save_steps or max(2, min(25, steps // 5))
    count = faults if faults is not None else max(len(kinds), steps // 50)
    faults_plan = plan(steps, count, tuple(kinds), seed, first_step=save_steps + 1)
    cfg = AsyncGRPOConfig.load(default_config_path(), ["--seed", str(seed), *overrides])  # the toy world, the eval
    world = toy_world(cfg)
    work = Path(workdir or DEFAULT_WORKDIR)
    for name in OWN_PATHS:  # what an earlier chaos run left: its checkpoints would be resumed, not started afresh
        shutil.rmtree(work / name, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("*.log"):
        old.unlink()
    key = secrets.token_hex(24)  # the receiver's and the server's key, in the trainer's environment too
    started = time.monotonic()
    result: dict = {"steps": steps, "seed": seed, "save_steps": save_steps, "plan": faults_plan,
                    "workload": WORKLOAD, "rollout_side": rollout_side, "overrides": overrides}
    seen: dict[int, str] = {}
    with contextlib.ExitStack() as stack:
        server = Server(world.model_dir, key, work / "vllm.log")
        stack.callback(server.stop)
        server.start()
        receiver = Receiver(work / "receiver", server.url, key, work / "receiver.log")
        stack.callback(receiver.stop)
        receiver.start()
        rollout_key = generate_key() if rollout_side == "serve" else None
        serve = RolloutServe(work, run_environment(key, rollout_key)) if rollout_key else None
        launch = Launch(default_config_path(), _run_args(work, "run", server, receiver, steps, seed, save_steps,
                                                         overrides, serve.address if serve else None),
                        work / "run-adapters", key, work, rollout_key=rollout_key)
        stack.callback(lambda: [s.group.stop() for s in launch.segments])
        if serve is not None:
            stack.callback(serve.stop)
        chaos = Chaos(server=server, receiver=receiver, launch=launch, output_dir=work / "run", steps=steps,
                      faults=faults_plan, seed=seed, rollout_serve=serve)
        summary = chaos.drive()
        seen.update(chaos.seen)
        lost, resent = lost_and_resent(work / "run" / "tensorboard")
        result.update(finished=summary is not None and summary["steps"] == steps, faults=chaos.records,
                      faults_by_kind=by_kind(chaos.records), segments=chaos.segments,
                      runs_resumed=len(chaos.segments) - 1 if summary else len(chaos.segments),
                      steps_redone=sum(s.get("steps_redone", 0) for s in chaos.segments),
                      groups_lost=lost, groups_resent=resent, memory=chaos.memory(),
                      final_run_lost_groups=summary["lost_groups"] if summary else None,
                      final_run_resent_groups=summary["resent_groups"] if summary else None,
                      chaos_wall_s=round(time.monotonic() - started, 1))
        client = stack.enter_context(InferenceClient(server.url, api_key=key))
        if summary is not None:
            rows = load_prompts(world.heldout_file, _tokenizer(world), cfg.prompt_column)[:8]
            result["served_vs_trained"] = served_vs_exported(
                client, summary["adapter_name"], summary["final_adapter"], world.model_dir,
                [r.prompt_ids for r in rows], max_tokens=cfg.max_completion_length, temperature=cfg.temperature)
            result["heldout_reward"] = round(heldout_rewards(cfg, client, summary["adapter_name"], world)["sampled"], 4)
        if baseline:
            result["baseline"] = _baseline(work, server, receiver, key, steps, seed, save_steps, overrides, cfg,
                                           client, world, seen)
    result["left_running"] = left_running(seen)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["goal"] = goal(result)
    return result


def _tokenizer(world):
    from transformers import AutoTokenizer  # heavy: transformers, only to tokenise the held-out prompts

    return AutoTokenizer.from_pretrained(world.model_dir)


def _baseline(work, server, receiver, key, steps, seed, save_steps, overrides, cfg, client, world, seen) -> dict:
    """The same run with no fault, on the same server and receiver: its held-out reward and wall time."""
    launch = Launch(default_config_path(), _run_args(work, "baseline", server, receiver, steps, seed, save_steps,
                                                     overrides), work / "baseline-adapters", key, work)
    segment = launch.start(resume=False)
    t0 = time.monotonic()
    try:
        while segment.group.process.poll() is None:
            for p in tree(segment.group.pid):
                with contextlib.suppress(psutil.Error):
                    seen.setdefault(p.pid, " ".join(p.cmdline())[:200])
            time.sleep(1.0)
    finally:
        code = segment.group.stop()
    if code != 0:
        return {"exit_code": code, "log": str(segment.log_path)}
    summary = json.loads((work / "baseline" / "run_summary.json").read_text())
    return {"heldout_reward": round(heldout_rewards(cfg, client, summary["adapter_name"], world)["sampled"], 4),
            "wall_s": round(time.monotonic() - t0, 1), "lost_groups": summary["lost_groups"]}


def goal(result: dict) -> dict:
    """Every fault survived or ended with a clear error and a checkpoint it resumed from; the run reached its steps
    with nothing it trained lost (every lost group generated again); memory growth below 2% per 100 steps."""
    handled = all(r["outcome"] == "survived" or (r["outcome"] == "ended_run" and r["kind"] not in SURVIVABLE)
                  for r in result.get("faults", []))
    clear = all(s["exit_code"] == 0 or s.get("errors") for s in result.get("segments", []))
    growth = [m["growth"]["pct_per_100_steps"] for m in result.get("memory", {}).values() if m["growth"]]
    memory_ok = bool(growth) and max(growth) < 2.0
    # A run that ends loses what it generated since its checkpoint on purpose (the resumed run generates it again
    # from the checkpoint's data position); within the run that finished, every lost group was sent again.
    nothing_lost = bool(result.get("finished")) and result["final_run_lost_groups"] == result["final_run_resent_groups"]
    return {"every_fault_handled": handled and clear, "nothing_lost": nothing_lost,
            "memory_growth_below_2pct_per_100_steps": memory_ok, "nothing_left_running": not result["left_running"],
            "met": handled and clear and nothing_lost and memory_ok and not result["left_running"]}
