"""Checks of an inference server against a config, one small function each, returning a CheckResult (pass, fail
with the fix, or skip with the reason); each failure names the flag or key to change.

`asyncgrpo doctor` prints them and `train` runs them before its first step (rollout/preflight.py runs the list,
SERVER_CHECKS, in order). What each check reads: docs/running.md, "Checking the setup".
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from asyncgrpo.errors import InferenceServerError
from asyncgrpo.inference.client import NEUTRAL_SAMPLING

log = logging.getLogger(__name__)

MIN_VLLM = (0, 10, 2)  # `return_token_ids` in completions: exact sampled ids, no re-tokenizing
SERVE_HINT = "launch/vllm/serve.sh and `python -m asyncgrpo.inference_node.vllm_server` set it"
# config.json keys that do not change what the model computes
_IGNORED_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache"}


@dataclass
class CheckResult:
    """One check's outcome: `ok` True (pass), False (fail: `fix` says what to do) or None (skipped: `detail` says
    why it could not be checked)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""

    def line(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]
        text = f"{mark}  {self.name}: {self.detail}"
        return f"{text}. Fix: {self.fix}" if self.ok is False and self.fix else text


class ServerCheckKeys(Protocol):
    """The config keys the server checks read (ModelSettings' lora_r, AsyncSettings' max_staleness and sync_mode,
    GenerationSettings' sampling): a protocol, so that a test hands only the keys its check reads."""

    lora_r: int
    max_staleness: int
    sync_mode: str
    temperature: float
    top_p: float


@dataclass
class ServerContext:
    """What the checks of one server share: the config, the client, the trainer's model, cached answers."""

    cfg: ServerCheckKeys
    client: object
    model_path: str
    probe_dir: Path | None = None  # a probe adapter written once for all servers (None: the directory is unusable)
    delivery: object = None  # how adapters reach the server (rollout/delivery.py); None: it reads probe_dir in place
    cache: dict = field(default_factory=dict)

    def server_config(self) -> dict | None:
        if "server_config" not in self.cache:
            self.cache["server_config"] = self.client.server_config()
        return self.cache["server_config"]


def adapters_needed(max_staleness: int) -> int:
    """Adapter versions one run may hold loaded on a server at once, what its `--max-loras` must allow (the doctor
    checks it; the demos and benchmarks start their servers with it): while version V+1 loads, V is served and
    requests in flight may still use each of the `max_staleness` versions before it (a request is sent only with a
    version its batch may train on, rollout/admission.py, and each publish retires every older version none uses).

    Not one more: the base model needs no slot, and a demo's held-out evaluation uses the version its run left
    loaded. Past the limit vLLM fails nothing (`max_loras` is the most adapters in one engine batch): requests on
    the extra adapter wait for a batch with room."""
    return max_staleness + 2


# ---- server checks ---------------------------------------------------------------------------------------

def check_reachable(ctx: ServerContext) -> CheckResult:
    if ctx.client.health():
        return CheckResult("reachable", True, f"{ctx.client.base_url}/health answers 200")
    return CheckResult("reachable", False, f"no answer 200 from {ctx.client.base_url}/health",
                       "start the server (launch/vllm/serve.sh) or fix vllm_server_base_url")


def check_version(ctx: ServerContext) -> CheckResult:
    version = ctx.client.version()
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:3])
    if numbers and numbers < MIN_VLLM:
        return CheckResult("vLLM version", False, f"{version} is older than {'.'.join(map(str, MIN_VLLM))}",
                           "upgrade vLLM on the inference node")
    return CheckResult("vLLM version", True, version)


def check_lora_enabled(ctx: ServerContext) -> CheckResult:
    config = ctx.server_config()
    if config is None:
        return _no_server_info("LoRA enabled")
    if not config.get("lora_config"):
        return CheckResult("LoRA enabled", False, "the server serves no LoRA adapters",
                           f"restart it with --enable-lora --max-lora-rank {max(8, ctx.cfg.lora_r)} "
                           f"--max-loras {adapters_needed(ctx.cfg.max_staleness)}")
    return CheckResult("LoRA enabled", True, "--enable-lora")


def check_max_lora_rank(ctx: ServerContext) -> CheckResult:
    lora = (ctx.server_config() or {}).get("lora_config")
    if not lora:
        return _no_server_info("max_lora_rank") if ctx.server_config() is None else \
            CheckResult("max_lora_rank", None, "LoRA is not enabled")
    rank = lora.get("max_lora_rank", 0)
    if rank < ctx.cfg.lora_r:
        return CheckResult("max_lora_rank", False, f"--max-lora-rank {rank} is below lora_r={ctx.cfg.lora_r}",
                           f"restart it with --max-lora-rank {ctx.cfg.lora_r} (vLLM accepts 1, 8, 16, 32, 64, ...), "
                           f"or lower lora_r")
    return CheckResult("max_lora_rank", True, f"--max-lora-rank {rank} >= lora_r={ctx.cfg.lora_r}")


def check_max_loras(ctx: ServerContext) -> CheckResult:
    lora = (ctx.server_config() or {}).get("lora_config")
    if not lora:
        return _no_server_info("max_loras") if ctx.server_config() is None else \
            CheckResult("max_loras", None, "LoRA is not enabled")
    have, need = lora.get("max_loras", 0), adapters_needed(ctx.cfg.max_staleness)
    if have < need:
        return CheckResult("max_loras", False, f"--max-loras {have}, but this run may serve {need} adapter versions "
                           f"at once (max_staleness + 2)",
                           f"restart it with --max-loras {need}, or lower max_staleness")
    return CheckResult("max_loras", True, f"--max-loras {have} >= {need} (max_staleness + 2)")


def check_runtime_lora_updating(ctx: ServerContext) -> CheckResult:
    if ctx.client.has_route("POST", "/v1/load_lora_adapter"):
        return CheckResult("runtime LoRA updating", True, "/v1/load_lora_adapter exists")
    return CheckResult("runtime LoRA updating", False, "the server has no /v1/load_lora_adapter route",
                       f"start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora ({SERVE_HINT})")


def check_dev_mode(ctx: ServerContext) -> CheckResult:
    present = ctx.client.has_route("GET", "/is_paused")
    if ctx.cfg.sync_mode != "pause":
        state = "present" if present else "absent"
        return CheckResult("dev mode", True, f"{state}; not needed with sync_mode: {ctx.cfg.sync_mode}")
    if present:
        return CheckResult("dev mode", True, "/pause, /resume, /is_paused exist (sync_mode: pause)")
    return CheckResult("dev mode", False, "sync_mode: pause needs /pause and /resume, and the server has neither",
                       f"start it with VLLM_SERVER_DEV_MODE=1 ({SERVE_HINT}), or set sync_mode: versioned")


def check_base_model(ctx: ServerContext) -> CheckResult:
    """Same directory; else (both readable here) equal config.json; else the same final name component."""
    base = next((m for m in ctx.client.models() if m.get("parent") is None), None)
    if base is None:
        return CheckResult("base model", False, "/v1/models lists no base model", "check the server's --model")
    served, mine = str(base.get("root") or base["id"]), ctx.model_path
    if _same_dir(served, mine):
        return CheckResult("base model", True, f"the server serves {served}, the trainer's model")
    served_cfg, my_cfg = _read_config(served), _read_config(mine)
    if served_cfg is not None and my_cfg is not None:
        diff = sorted(k for k in (served_cfg.keys() | my_cfg.keys()) - _IGNORED_CONFIG_KEYS
                      if served_cfg.get(k) != my_cfg.get(k))
        if diff:
            return CheckResult("base model", False, f"the server serves {served}, whose config.json differs from "
                               f"{mine}'s in {', '.join(diff[:6])}", _MODEL_FIX)
        return CheckResult("base model", True, f"{served} (server) and {mine} (trainer) have equal config.json")
    if _name(served) == _name(mine):
        return CheckResult("base model", True, f"the server serves {served}: same name as {mine} (config.json not "
                           f"readable here, shapes not compared)")
    return CheckResult("base model", False, f"the server serves {served}, the trainer loads {mine}", _MODEL_FIX)


_MODEL_FIX = "serve the trainer's base model (vLLM --model) or set model_name_or_path to the served one"


def check_probe_adapter(ctx: ServerContext) -> CheckResult:
    """Load the probe adapter from `lora_adapter_path` under a unique name, read it back, unload it."""
    if ctx.probe_dir is None:
        return CheckResult("adapter readable by server", None,
                           "not checked: no probe adapter (see the adapter directory checks)")
    probe_name = f"asyncgrpo-doctor-{uuid.uuid4().hex[:8]}"
    uploaded = ctx.delivery is not None and ctx.delivery.name == "http"
    try:
        if uploaded:  # through the receiver beside the server, as every version will go
            ctx.delivery.stage(ctx.client, probe_name, ctx.probe_dir)
            ctx.delivery.load(ctx.client, probe_name, ctx.probe_dir)
        else:
            ctx.client.load_adapter(probe_name, ctx.probe_dir)
    except InferenceServerError as exc:
        fix = ("see the message; start the receiver beside the server (launch/vllm/receiver.sh) with the same "
               "API key") if uploaded else (
            f"make {ctx.probe_dir.parent.parent} readable on the inference node at the same path (shared storage), "
            f"set lora_adapter_path to such a directory, or use adapter_delivery: http (docs/delivery.md)"
        ) if exc.status == 404 else "see the server's message; check lora_r and lora_target_modules against the " \
                                    "served model"
        return CheckResult("adapter readable by server", False, f"loading a probe adapter failed: {exc}", fix)
    try:
        served = ctx.client.adapter_paths().get(probe_name)
    finally:
        ctx.client.unload_adapter(probe_name)
    want = ctx.delivery.served_path(ctx.client, probe_name, ctx.probe_dir) if uploaded else str(ctx.probe_dir)
    if served is None or not (served == want if uploaded else _same_dir(served, want)):
        return CheckResult("adapter readable by server", False, f"the server reports the probe at {served!r} after "
                           f"loading {want}", "check that nothing else manages adapters on this server")
    where = f"uploaded to {want}" if uploaded else f"in {ctx.probe_dir.parent.parent}"
    return CheckResult("adapter readable by server", True, f"a rank-{ctx.cfg.lora_r} probe adapter {where} loaded "
                       f"and unloaded")


def check_receiver(ctx: ServerContext) -> CheckResult | None:
    """With `adapter_delivery: http`: the receiver beside the server answers /health and accepts our API key
    (None, no line at all, with shared_fs)."""
    if ctx.delivery is None or ctx.delivery.name != "http":
        return None
    receiver = ctx.delivery.receivers[ctx.client.base_url]
    if not receiver.health():
        return CheckResult("adapter receiver", False, f"no answer from {receiver.base_url}/health",
                           "start it beside vLLM (launch/vllm/receiver.sh) or fix adapter_receiver_url")
    try:
        committed = receiver.committed()
    except InferenceServerError as exc:
        return CheckResult("adapter receiver", False, str(exc), "start the receiver with the trainer's API key "
                           "(ASYNCGRPO_VLLM_API_KEY in both environments)")
    return CheckResult("adapter receiver", True, f"{receiver.base_url} answers with our key ({len(committed)} "
                       f"versions stored)")


def paused_state(client) -> bool | None:
    """`GET /is_paused`; None where the server has no such route (dev mode off: nothing can pause it)."""
    try:
        return client.is_paused()
    except InferenceServerError as exc:
        if exc.status == 404:
            return None
        raise


def check_not_paused(ctx: ServerContext) -> CheckResult:
    """A server left paused (a run killed during a weight sync) holds every request until someone resumes it."""
    url = ctx.client.base_url
    paused = paused_state(ctx.client)
    if paused is None:
        return CheckResult("not paused", True, "no /is_paused route (dev mode off): nothing can pause it")
    if paused:
        return CheckResult("not paused", False, f"{url} is paused (GET /is_paused answers true), most likely by a run "
                           f"killed during a weight sync; it holds every request",
                           f"`curl -X POST {url}/resume` (POST /resume); `asyncgrpo train` resumes it at start")
    return CheckResult("not paused", True, "GET /is_paused answers false")


PROBE_TEMPERATURE = 0.5  # far enough from 1 that processed logprobs move by much more than float noise
PROBE_PROMPT = [1, 2, 3, 4]  # any ids exist in any vocabulary; the model's answer need not make sense
LOGPROBS_TOLERANCE = 1e-3  # raw logprobs of one prompt agree to ~1e-6 between requests; processed ones move by ~0.1+


def logprobs_mode(ctx: ServerContext) -> tuple[str, str]:
    """(`raw_logprobs` | `processed_logprobs` | other mode name, how it was found): read from the server's config
    (`/server_info`, dev mode), else probed: the first token's top logprobs at temperature 1 and at
    PROBE_TEMPERATURE are equal for raw logprobs and differ for processed ones."""
    mode = (((ctx.server_config() or {}).get("model_config") or {}).get("logprobs_mode"))
    if mode:
        return str(mode), "from /server_info"
    model = ctx.client.base_model()
    at_one = ctx.client.first_token_logprobs(model, PROBE_PROMPT, temperature=1.0)
    at_t = ctx.client.first_token_logprobs(model, PROBE_PROMPT, temperature=PROBE_TEMPERATURE)
    common = at_one.keys() & at_t.keys()
    assert common, "the most likely first token is among the top logprobs at both temperatures"
    moved = max(abs(at_one[k] - at_t[k]) for k in common)
    how = f"probed: top logprobs moved by {moved:.3g} between temperature 1 and {PROBE_TEMPERATURE:g}"
    return ("raw_logprobs" if moved < LOGPROBS_TOLERANCE else "processed_logprobs"), how


def sampling_changes_logprobs(cfg: ServerCheckKeys) -> list[str]:
    """The config's sampling settings under which the sampled distribution differs from the model's raw one."""
    changes = []
    if cfg.temperature != 1.0:
        changes.append(f"temperature {cfg.temperature:g}")
    if cfg.top_p < 1.0:
        changes.append(f"top_p {cfg.top_p:g}")
    top_k = getattr(cfg, "top_k", None)
    if top_k not in (None, 0, -1):
        changes.append(f"top_k {top_k}")
    for key, neutral in (("min_p", 0.0), ("repetition_penalty", 1.0)):
        value = getattr(cfg, key, None)
        if value is not None and value != neutral:
            changes.append(f"{key} {value:g}")
    return changes


def check_logprobs_mode(ctx: ServerContext) -> CheckResult:
    """The behaviour logprobs must be those of the distribution that was sampled (`processed_logprobs`)."""
    mode, how = logprobs_mode(ctx)
    if mode == "processed_logprobs":
        return CheckResult("logprobs mode", True, f"processed_logprobs ({how})")
    changes = sampling_changes_logprobs(ctx.cfg)
    if not changes:
        return CheckResult("logprobs mode", True, f"{mode} ({how}); equal to processed logprobs for this config "
                           f"(temperature 1, no truncation), but not if you change its sampling")
    return CheckResult("logprobs mode", False, f"the server returns {mode} ({how}), the logprobs of the model before "
                       f"{', '.join(changes)}: every completion would be trained as if off-policy",
                       f"restart it with --logprobs-mode processed_logprobs ({SERVE_HINT})")
# Sampling fields vLLM takes from a model's generation_config.json (or --override-generation-config) for a request
# that leaves them out (vLLM 0.32, ModelConfig.get_diff_sampling_param).
SAMPLING_DEFAULT_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                         "top_p", "min_p")
GENERATION_DEFAULTS_PROBE = {
    # A hot temperature flattens the distribution, so that a top_k or min_p default cuts visible mass (a trained
    # model puts nearly all of it on a few tokens at temperature 1); sent in both requests, it cancels out.
    "temperature": 2.0,  # the most vLLM accepts
    "k": 20,  # top logprobs compared: vLLM's default --max-logprobs
    "tolerance": 1e-4,  # fp32 noise between two batches is ~1e-6; a default that matters moves logprobs by >1e-2
    "prompt": list(range(3, 35)) * 2,  # each token twice: a repetition_penalty default changes their logits
}


def check_generation_config(ctx: ServerContext) -> CheckResult:
    """The server fills omitted sampling fields with vLLM's neutral values (`--generation-config vllm`), not with
    the model's generation_config.json. Read back from /server_info where it exists; otherwise (and when the
    server does use the model's file) probe: the top next-token logprobs with every field sent at its neutral
    value must equal those of a request that sends only the temperature."""
    name = "no model sampling defaults"
    fix = f"restart the server with --generation-config vllm ({SERVE_HINT})"
    source = None
    config = ctx.server_config()
    if config is not None:
        model_config = config.get("model_config") or {}
        source = model_config.get("generation_config", "auto")
        overrides = sorted(set(model_config.get("override_generation_config") or {}) & set(SAMPLING_DEFAULT_KEYS))
        if overrides:
            return CheckResult(name, False, f"--override-generation-config sets {', '.join(overrides)} for every "
                               "request that leaves them out", "remove them from --override-generation-config")
        if source == "vllm":
            return CheckResult(name, True, "--generation-config vllm")
    probe, model = GENERATION_DEFAULTS_PROBE, ctx.client.base_model()
    temperature = {"temperature": probe["temperature"], "top_p": 1.0}
    explicit = ctx.client.next_token_logprobs(model, probe["prompt"], k=probe["k"],
                                              sampling={**temperature, **NEUTRAL_SAMPLING})
    omitted = ctx.client.next_token_logprobs(model, probe["prompt"], k=probe["k"], sampling=temperature)
    diff = max((abs(lp - omitted[t]) for t, lp in explicit.items() if t in omitted), default=float("inf"))
    where = f"--generation-config {source}" if source else "/server_info absent, probed"
    if diff > probe["tolerance"]:
        return CheckResult(name, False, f"the server fills sampling fields a request leaves out from the model's "
                           f"generation_config.json ({where}): next-token logprobs move by up to {diff:.3g} when "
                           f"top_k, min_p and the penalties are left out", fix)
    return CheckResult(name, True, f"{where}, but leaving top_k, min_p and the penalties out changes no logprobs "
                       f"(max {diff:.1e}): the model's file sets none of them")


SERVER_CHECKS: list[Callable[[ServerContext], CheckResult]] = [
    check_reachable, check_version, check_lora_enabled, check_max_lora_rank, check_max_loras,
    check_runtime_lora_updating, check_dev_mode, check_base_model, check_receiver, check_probe_adapter,
    check_generation_config,
]
SERVER_CHECKS += [check_not_paused, check_logprobs_mode]  # faults (issue 13)


# ---- helpers -------------------------------------------------------------------------------------------------

def _no_server_info(name: str) -> CheckResult:
    return CheckResult(name, None, "not checked: the server has no /server_info (VLLM_SERVER_DEV_MODE unset)")


def title(check) -> str:
    """The name a check's results carry (for the skipped line of a check that did not run)."""
    return {check_version: "vLLM version", check_lora_enabled: "LoRA enabled", check_max_lora_rank: "max_lora_rank",
            check_max_loras: "max_loras", check_runtime_lora_updating: "runtime LoRA updating",
            check_dev_mode: "dev mode", check_base_model: "base model",
            check_probe_adapter: "adapter readable by server", check_receiver: "adapter receiver",
            check_not_paused: "not paused",
            check_logprobs_mode: "logprobs mode",
            check_generation_config: "no model sampling defaults"}.get(check, check.__name__.removeprefix("check_"))


def _same_dir(a: str, b: str) -> bool:
    try:
        return os.path.isdir(a) and os.path.isdir(b) and os.path.samefile(a, b)
    except OSError:
        return False


def _read_config(path: str) -> dict | None:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1].lower()
