"""`asyncgrpo bench producer --json [--duration 5]`: how far one rollout process goes, in completion tokens per second
ingested (parsed, decoded, scored, queued) when the server answers at once.

The real rollout parts run against `bench/loadgen.py`, with 0, 1, 2 and 4 reward worker processes; each run reports
where its CPU time went, per stage and per process. The figures: docs/benchmarks.md ("`bench producer`").
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from transformers import PreTrainedTokenizerFast

from asyncgrpo.children import GroupProcess
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import PromptRow
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout import build, scoring
from asyncgrpo.rollout.build import build_producer
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.toy.tokenizer import build_tokenizer

WORKERS = (0, 1, 2, 4)
DEFAULT_DURATION_S = 5.0
WARMUP_S = 1.0  # untimed: the first requests open connections and fill the loaded generator's answer cache
LOADGEN_START_S = 30.0  # the load generator imports only the standard library: it listens within a second
TAKE_TIMEOUT_S = 60.0  # the consumer's wait for a batch; the load generator answers in milliseconds
REWARD = "asyncgrpo.rewards:math_accuracy"
# The workload: 32 prompts x 8 completions of 256 tokens per batch, generation one batch ahead (max_staleness 1).
SETTINGS = ["--model_name_or_path", "toy", "--dataset_name", "toy",  # named, as every config must; rows are the bench's
            "--num_generations", "8", "--max_completion_length", "256", "--per_device_train_batch_size", "256",
            "--max_staleness", "1", "--max_inflight_requests", "32", "--reward_funcs", REWARD,
            # the number comparison (~0.1 ms per completion) as when the figures in benchmarks.md were measured;
            # math-verify, the default when installed, costs ~10 ms and would measure sympy instead of the producer
            "--reward_kwargs", "{math_accuracy: {grader: numbers}}"]
# A GSM8K-style worked solution: what math_accuracy reads (its last `#### N`) and about as long as real ones.
SOLUTION = ("Natalia sold 48 / 2 = 24 clips in May. Natalia sold 48 + 24 = 72 clips altogether in April and May. "
            "She earns 12 / 60 = 0.2 dollars per minute of babysitting; working 50 minutes, she earned 0.2 x 50 = 10 "
            "dollars. Weng earns $1,234.50 in total, so the answer is #### {answer}")
ANSWER = 72


def bench_completions(tokenizer, length: int, count: int = 8) -> list[dict]:
    """`count` fixed completions of exactly `length` tokens with the toy tokenizer: a worked solution (padded with
    more working, cut to fit) ending in `#### N` and EOS; every second one has the right answer, so groups have
    rewards 1 and 0 and advantages that are not all zero. Their token logprobs vary like sampled ones."""
    out = []
    eos = tokenizer.eos_token_id
    for i in range(count):
        tail = tokenizer.encode(f" #### {ANSWER if i % 2 == 0 else ANSWER + i}", add_special_tokens=False) + [eos]
        body = tokenizer.encode(SOLUTION.format(answer=ANSWER) * (length // 64 + 1), add_special_tokens=False,
                                verbose=False)  # longer than the toy model on purpose: it is cut below
        ids = body[:max(length - len(tail), 0)] + tail
        ids = ids[-length:]
        tokens = [tokenizer.decode([t]) for t in ids]
        logprobs = [-((k * 7919 + i * 104729) % 1000) / 997.0 - 1e-3 for k in range(len(ids))]
        out.append({"token_ids": ids, "tokens": tokens, "logprobs": logprobs,
                    "text": tokenizer.decode(ids, skip_special_tokens=True), "finish_reason": "stop"})
    return out


def bench_rows(tokenizer, count: int = 512):
    """Prompts in the toy tokenizer (about 40 tokens each) with a GSM8K-style `answer` column ending in `#### 72`."""
    rows = []
    for i in range(count):
        text = f"Question {i}: Natalia sold clips to {48 + i} of her friends in April. How many clips in total?"
        rows.append(PromptRow(prompt=text, prompt_ids=tokenizer.encode(text, add_special_tokens=False),
                              columns={"answer": f"She sold 48 + 24 = 72.\n#### {ANSWER}"}))
    return rows


class LoadGenerator:
    """`python -m asyncgrpo.bench.loadgen` in a process of its own, answering with `completions`."""

    def __init__(self, completions: list[dict]):
        src = str(Path(__file__).resolve().parents[2])  # this checkout's sources, whatever the caller's path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)}
        self._group = GroupProcess([sys.executable, "-m", "asyncgrpo.bench.loadgen", "--port", "0"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.process = self._group.process
        try:
            self.process.stdin.write(json.dumps({"completions": completions}))
            self.process.stdin.close()
            self.port = self._read_port()
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"
        self.pid = self.process.pid

    def _read_port(self) -> int:
        ready, _, _ = select.select([self.process.stdout], [], [], LOADGEN_START_S)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("listening "):
            raise RuntimeError(f"the load generator did not start within {LOADGEN_START_S:g} s (exit code "
                               f"{self.process.poll()}, said {line!r})")
        return int(line.split()[1])

    def stop(self) -> None:
        self._group.stop(grace_s=10)

    def __enter__(self) -> LoadGenerator:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class Stages:
    """CPU seconds per stage, measured with the thread CPU clock of the thread that ran it (threads share the GIL:
    their wall time would count each other's work)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def timed(self, name: str):
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._lock:
                self.cpu_s[name] = self.cpu_s.get(name, 0.0) + spent
                self.calls[name] = self.calls.get(name, 0) + 1

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self.cpu_s)


class TimedClient(InferenceClient):
    """The real client; `complete` (HTTP, JSON parse, Completion objects) is timed."""

    def __init__(self, *args, stages: Stages, **kwargs):
        super().__init__(*args, **kwargs)
        self.stages = stages

    def complete(self, *args, **kwargs):
        with self.stages.timed("http_json"):
            return super().complete(*args, **kwargs)


class TimedTokenizer:
    """The toy tokenizer with `decode` timed (everything else passed through)."""

    def __init__(self, tokenizer, stages: Stages):
        self._tokenizer, self._stages = tokenizer, stages

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, *args, **kwargs):
        with self._stages.timed("decode"):
            return self._tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class TimedScorer(RewardScorer):
    """The real scorer; `score` is timed."""

    stages: Stages | None = None

    def score(self, *args, **kwargs):
        with self.stages.timed("reward"):
            return super().score(*args, **kwargs)


class CountingQueue(RolloutQueue):
    """The real queue; `put` is timed and counts the groups and completion tokens queued."""

    def __init__(self, *args, stages: Stages, **kwargs):
        super().__init__(*args, **kwargs)
        self.stages = stages
        self.groups_put = 0
        self.tokens_put = 0

    def put(self, group) -> None:
        with self.stages.timed("queue_put"):
            super().put(group)
            with self.cond:
                self.groups_put += 1
                self.tokens_put += group.n_completion_tokens

    def counts(self) -> tuple[int, int, float]:
        """(groups, tokens) queued so far and the time, read together."""
        with self.cond:
            return self.groups_put, self.tokens_put, time.monotonic()


class TimedGroupScorer:
    """A reward worker pool with `score_group` timed: in this process that is handing the group over and reading
    the rewards back (decode and reward run in the workers, counted in `cpu_s.reward_workers`)."""

    def __init__(self, pool, stages: Stages):
        self._pool, self._stages = pool, stages

    def score_group(self, *args, **kwargs):
        with self._stages.timed("reward_handover"):
            return self._pool.score_group(*args, **kwargs)

    def __getattr__(self, name):  # fallbacks, close
        return getattr(self._pool, name)


def scoring_arguments(cfg, tokenizer, stages: Stages) -> dict:
    """The producer's scoring arguments, timed per stage. With the reward worker pool's interface
    (`rollout/scoring.py`, `reward_workers`): the producer takes a group scorer, in-thread or a pool of
    `reward_workers` processes. Without it (before that interface): a tokenizer and a RewardScorer, in-thread."""
    scorer = TimedScorer(list(cfg.reward_funcs), cfg.reward_weights, cfg.reward_fallback, cfg.reward_kwargs)
    scorer.stages = stages
    timed_tokenizer = TimedTokenizer(tokenizer, stages)
    if importlib.util.find_spec("asyncgrpo.rollout.scoring") is None:
        return {"tokenizer": timed_tokenizer, "scorer": scorer}

    if getattr(cfg, "reward_workers", 0) == 0:
        return {"scorer": scoring.InThreadScoring(scorer, timed_tokenizer, None)}
    # The workers load the tokenizer from the directory it was loaded from (`tokenizer.name_or_path`).
    return {"scorer": TimedGroupScorer(build.make_group_scorer(cfg, tokenizer, None), stages)}


def reward_workers_supported() -> bool:
    return "reward_workers" in {f.name for f in dataclasses.fields(AsyncGRPOConfig)}


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by these processes (gone ones count 0)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


def worker_pids(exclude: int) -> list[int]:
    """This process's child processes other than the load generator: the reward workers, where there are any."""
    return [p.pid for p in psutil.Process().children(recursive=True) if p.pid != exclude]


def consume(queue: RolloutQueue, producer, groups: int, stop: threading.Event, errors: list) -> None:
    """The trainer's side: take a batch at the current version, then serve the next version (set_policy)."""
    version = 0
    try:
        while not stop.is_set():
            queue.take(groups, trainer_version=version, timeout_s=TAKE_TIMEOUT_S)
            version += 1
            producer.set_policy(version, f"bench-v{version}")
    except BaseException as exc:  # noqa: BLE001 - re-raised by run_one
        if not stop.is_set():
            errors.append(exc)


def run_one(cfg, *, url: str, tokenizer, rows, workers: int, duration_s: float, warmup_s: float,
            loadgen_pid: int) -> dict:
    """One producer against the load generator: warm up, count what is queued during `duration_s`, stop."""
    stages = Stages()
    groups = cfg.groups_per_step(world_size=1)
    queue = CountingQueue(cfg.max_staleness, scale_rewards=cfg.scale_rewards, dynamic_sampling=cfg.dynamic_sampling,
                          stages=stages)
    scoring = scoring_arguments(cfg, tokenizer, stages)
    client = TimedClient(url, timeout_s=cfg.vllm_request_timeout, stages=stages)
    producer = build_producer(cfg, clients=[client], rows=rows, queue=queue, groups_per_step=groups, **scoring)
    stop, errors = threading.Event(), []
    consumer = threading.Thread(target=consume, args=(queue, producer, groups, stop, errors), name="bench-consumer",
                                daemon=True)
    producer.start()
    producer.set_policy(0, "bench-v0")
    consumer.start()
    try:
        time.sleep(warmup_s)
        workers_now = worker_pids(exclude=loadgen_pid)
        g0, tok0, t0 = queue.counts()
        cpu0 = (time.process_time(), process_cpu_s([loadgen_pid]), process_cpu_s(workers_now), stages.snapshot())
        time.sleep(duration_s)
        g1, tok1, t1 = queue.counts()
        cpu1 = (time.process_time(), process_cpu_s([loadgen_pid]), process_cpu_s(workers_now), stages.snapshot())
    finally:
        stop.set()
        producer.stop()
        client.close()
        close = getattr(scoring["scorer"], "close", None)  # reward worker processes (producer.stop closes them too)
        if close is not None:
            close()
    if errors or producer.error is not None:
        raise errors[0] if errors else producer.error
    elapsed, tokens = t1 - t0, tok1 - tok0
    own_cpu = cpu1[0] - cpu0[0]
    stage_cpu = {k: cpu1[3].get(k, 0.0) - cpu0[3].get(k, 0.0) for k in cpu1[3]}
    stage_cpu["other"] = own_cpu - sum(stage_cpu.values())
    per_mtok = (lambda s: round(s / tokens * 1e6, 3)) if tokens else (lambda s: None)  # noqa: E731
    return {"workers": workers, "tokens_per_s": round(tokens / elapsed, 1), "tokens_ingested": tokens,
            "groups_ingested": g1 - g0, "duration_s": round(elapsed, 6),
            # what one core ingests, whatever else shares the machine: the figure to compare between runs
            "tokens_per_producer_cpu_s": round(tokens / own_cpu, 1) if own_cpu > 0 else None,
            "batches_taken": queue.batches_taken, "dropped_stale": queue.dropped_stale,
            "cpu_s": {"producer_process": round(own_cpu, 3), "load_generator": round(cpu1[1] - cpu0[1], 3),
                      "reward_workers": round(cpu1[2] - cpu0[2], 3)},
            "stages_cpu_s": {k: round(v, 3) for k, v in stage_cpu.items()},
            "stages_cpu_s_per_million_tokens": {k: per_mtok(v) for k, v in stage_cpu.items()}}


def run(overrides: list[str] | None = None, duration_s: float = DEFAULT_DURATION_S, warmup_s: float = WARMUP_S,
        workers: tuple[int, ...] = WORKERS) -> dict:
    """Start the load generator, then one timed producer run per entry of `workers`."""
    supported = reward_workers_supported()
    with tempfile.TemporaryDirectory(prefix="bench-producer-") as tmp:
        # Saved and loaded back, as a trainer loads its tokenizer: reward workers load it from that directory.
        build_tokenizer().save_pretrained(Path(tmp) / "tokenizer")
        tokenizer = PreTrainedTokenizerFast.from_pretrained(Path(tmp) / "tokenizer")

        def config(n: int):
            extra = ["--reward_workers", str(n)] if supported else []
            return AsyncGRPOConfig.load(None, ["--lora_adapter_path", tmp, *SETTINGS, *(overrides or []), *extra])

        base = config(0)
        rows = bench_rows(tokenizer)
        load_before = os.getloadavg()
        with LoadGenerator(bench_completions(tokenizer, base.max_completion_length, base.num_generations)) as gen:
            runs = [run_one(config(n), url=gen.url, tokenizer=tokenizer, rows=rows, workers=n, duration_s=duration_s,
                            warmup_s=warmup_s, loadgen_pid=gen.pid) for n in workers]
    return {"runs": runs, "reward_workers_supported": supported,
            "settings": {"num_generations": base.num_generations, "completion_length": base.max_completion_length,
                         "groups_per_batch": base.groups_per_step(world_size=1),
                         "max_inflight": base.inflight_requests(base.groups_per_step(world_size=1)),
                         "max_staleness": base.max_staleness, "duration_s": duration_s, "warmup_s": warmup_s,
                         "reward": list(base.reward_funcs), "tokenizer": "asyncgrpo.toy (one token per byte)"},
            "overrides": overrides or [], "cores": len(os.sched_getaffinity(0)),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
