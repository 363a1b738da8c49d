"""Inference-server faults: wait for a server that stopped answering, and bring it back into service.

`ServerRecovery.recover` marks the server down (nothing is sent to it), polls `/health` with exponential backoff for
up to `vllm_server_timeout`, re-registers the live adapter (`restore`: a restarted vLLM knows none), then marks it
up. One thread recovers a server while others that failed on it wait; one that never comes back stays failed, and
every later caller gets the same error, naming the fix. The rules and why: docs/rollout-internals.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncgrpo import receiver_timeouts as receiver
from asyncgrpo.config import InferenceSettings, LaunchSettings
from asyncgrpo.errors import ConfigError, InferenceServerError
from asyncgrpo.inference.client import CONNECT_BACKOFF_S, CONNECT_RETRIES, CONNECT_TIMEOUT_S

log = logging.getLogger(__name__)

@dataclass
class TimeoutSettings(InferenceSettings, LaunchSettings):
    """What the ddp_timeout checks read: the inference timeouts (InferenceSettings) against ddp_timeout
    (LaunchSettings)."""


FIRST_BACKOFF_S = 0.5  # first health poll after a failure: a restart on CPU takes ~30 s, a GPU node minutes
MAX_BACKOFF_S = 5.0  # polls never get further apart than this, so a returning server is back within ~5 s


def backoff_delays(timeout_s: float, first_s: float = FIRST_BACKOFF_S, max_s: float = MAX_BACKOFF_S) -> list[float]:
    """The waits between health polls: doubling from `first_s`, capped at `max_s`, summing to `timeout_s`."""
    delays, total, delay = [], 0.0, first_s
    while total < timeout_s:
        step = min(delay, max_s, timeout_s - total)
        delays.append(step)
        total += step
        delay *= 2
    return delays


def connect_retry_s(connect_retries: int = CONNECT_RETRIES, backoff_s: float = CONNECT_BACKOFF_S) -> float:
    """The longest one call spends on an unreachable server before it is reported: every attempt's connect timeout
    (a node that drops packets) plus the backoffs between attempts (InferenceClient's defaults, which train uses)."""
    return (connect_retries + 1) * CONNECT_TIMEOUT_S + backoff_s * (2 ** connect_retries - 1)


def outage_s(inference: InferenceSettings) -> float:
    """The longest rank 0 can be kept from the next collective by one inference-server outage that the run is built
    to survive: a call gives up on the dead server (connection retries), the server is waited for
    (`vllm_server_timeout`), then the groups or the sync it held up are redone (`vllm_request_timeout`)."""
    return connect_retry_s() + inference.vllm_server_timeout + inference.vllm_request_timeout


def batch_wait_s(inference: InferenceSettings) -> float:
    """How long rank 0 waits for a batch from the rollout queue before it gives up (trainer/recipe.py): several
    rounds of requests, one of them held up by an outage the run waits out."""
    return inference.vllm_request_timeout * 4 + inference.vllm_server_timeout


def delivery_s(inference: InferenceSettings) -> float:
    """With `adapter_delivery: http`, the longest one version's delivery to a receiver may take and still succeed:
    every file's upload, the commit and the load, each within its connect and read timeouts (receivers are
    delivered to in parallel). 0 with shared_fs: the servers read the files themselves."""
    if inference.adapter_delivery != "http":
        return 0.0
    return (receiver.ADAPTER_FILES * (receiver.CONNECT_TIMEOUT_S + receiver.UPLOAD_TIMEOUT_S)
            + 2 * (receiver.CONNECT_TIMEOUT_S + receiver.ADMIN_TIMEOUT_S))


def sync_wait_s(inference: InferenceSettings) -> float:
    """The longest one weight sync can keep rank 0 away: an outage it waits out, plus (http) the delivery before the
    pause and the one again when the outage's restore finds a restarted receiver without the version, and a
    receiver outage waited out (`vllm_server_timeout`, rollout/delivery.py)."""
    receiver_outage = inference.vllm_server_timeout if delivery_s(inference) else 0.0
    return outage_s(inference) + 2 * delivery_s(inference) + receiver_outage


def evaluation_wait_s(inference: InferenceSettings, prompts: int, concurrency: int) -> float:
    """How long one held-out evaluation can keep rank 0 away (rollout/evaluation.py): its `prompts` go out
    `concurrency` at a time, so each request thread makes ceil(prompts / concurrency) requests in turn, each within
    vllm_request_timeout, one of them held up by an outage the run waits out. 0 without prompts."""
    if prompts <= 0:
        return 0.0
    return (math.ceil(prompts / concurrency) - 1) * inference.vllm_request_timeout + outage_s(inference)


def check_evaluation_fits_ddp_timeout(cfg: TimeoutSettings, world_size: int, wait_s: float) -> None:
    """At start, once the held-out prompts are known: with several ranks, the others wait in a collective while rank
    0 evaluates (`wait_s`, `evaluation_wait_s`), so ddp_timeout must be longer, as for a batch or a sync."""
    if world_size <= 1 or cfg.ddp_timeout > wait_s:
        return
    raise ConfigError(
        "ddp_timeout", f"{cfg.ddp_timeout} s is not longer than the longest held-out evaluation the run survives, "
        f"{wait_s:g} s (eval_dataset's prompts in turns of vllm_request_timeout {cfg.vllm_request_timeout:g} s, one "
        f"through a server outage of {outage_s(cfg):g} s); ranks other than 0 would time out in a collective meanwhile",
        f"set ddp_timeout: {math.floor(wait_s) + 1} or more, or evaluate fewer prompts (eval_dataset)")


def check_outage_fits_ddp_timeout(cfg: TimeoutSettings, world_size: int) -> None:
    """At start: with several ranks, the others wait in a collective (at most `ddp_timeout`) while rank 0 waits for
    a batch or for a sync; a ddp_timeout shorter than the longest of those waits kills them while rank 0 would still
    have succeeded. The suggested value is the smallest that passes."""
    batch, sync = batch_wait_s(cfg), sync_wait_s(cfg)
    need = max(batch, sync)
    if world_size <= 1 or cfg.ddp_timeout > need:
        return
    enough = math.floor(need) + 1
    uploads = (f" + 2 x {delivery_s(cfg):g} s of adapter uploads and a receiver outage of vllm_server_timeout "
               f"(adapter_delivery: http)" if delivery_s(cfg) else "")
    raise ConfigError(
        "ddp_timeout", f"{cfg.ddp_timeout} s is not longer than the longest wait of rank 0 that the run survives, "
        f"{need:g} s: a batch from the rollout queue waits up to 4 x vllm_request_timeout "
        f"{cfg.vllm_request_timeout:g} s + vllm_server_timeout {cfg.vllm_server_timeout:g} s = {batch:g} s; a weight "
        f"sync through a server outage up to vllm_server_timeout + vllm_request_timeout + {connect_retry_s():g} s of "
        f"connection retries{uploads} = {sync:g} s; ranks other than 0 would time out in a collective meanwhile",
        f"set ddp_timeout: {enough} or more, or lower vllm_server_timeout or vllm_request_timeout")


class ServerRecovery:
    """Health state of every inference server, and the one place that recovers a server after a fault.

    `restore(client)` puts back what the server must serve (the publisher's current adapter); every function in
    `listeners` is called whenever a server goes down or up (rollout/build.py adds the producer's schedule, which
    then decides again). `clock`/`sleep` are injectable for unit tests of the backoff."""

    def __init__(self, timeout_s: float, *, restore: Callable[[object], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        self.timeout_s = timeout_s
        self.restore = restore
        self.listeners: list[Callable[[], None]] = []
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()  # guards the dicts below
        self._server_locks: dict[str, threading.Lock] = {}  # one recovery at a time per server
        self._epoch: dict[str, int] = {}  # recoveries finished per server
        self._down: set[str] = set()
        self._failed: dict[str, InferenceServerError] = {}
        self.recoveries = 0  # servers brought back (logged, and read by tests)
        self._failed_calls: dict[str, int] = {}  # calls that failed on a server during its current outage

    def epoch(self, client) -> int:
        """Read before a call: `recover(client, epoch)` then knows whether someone recovered it since."""
        with self._lock:
            return self._epoch.get(client.base_url, 0)

    def is_up(self, client) -> bool:
        with self._lock:
            return client.base_url not in self._down

    def recover(self, client, seen_epoch: int, cause: BaseException | None = None) -> None:
        """Block until `client`'s server answers again and serves the current adapter; raises InferenceServerError
        if it does not within `timeout_s`. Returns at once if another thread recovered it after `seen_epoch`."""
        url = client.base_url
        with self._lock:
            server_lock = self._server_locks.setdefault(url, threading.Lock())
            if self._epoch.get(url, 0) == seen_epoch:  # a failure of this outage (not of one already over)
                self._failed_calls[url] = self._failed_calls.get(url, 0) + 1
        with server_lock:
            with self._lock:
                if url in self._failed:
                    raise self._failed[url]
                if self._epoch.get(url, 0) != seen_epoch:
                    return  # recovered by another thread while this one waited
                self._down.add(url)
            self._notify()
            log.warning("inference server %s stopped answering (%s); waiting up to %g s (vllm_server_timeout) for it "
                        "to come back", url, cause, self.timeout_s)
            try:
                waited = self._wait_healthy(client)
                if self.restore is not None:
                    self.restore(client)
            except InferenceServerError as exc:
                error = exc if isinstance(exc, ServerGoneError) else InferenceServerError(
                    f"inference server {url} came back but the current adapter could not be re-registered on it: "
                    f"{exc}")
                with self._lock:
                    self._failed[url] = error
                raise error from exc
            with self._lock:
                self._epoch[url] = seen_epoch + 1
                self._down.discard(url)
                self.recoveries += 1
                failed = self._failed_calls.pop(url, 0)
            # One line per outage (and the one above), whatever the number of requests that failed meanwhile.
            log.warning("inference server %s is back after %.1f s; the current adapter is registered on it; %d "
                        "call%s failed during the outage (lost rollouts are generated again)", url, waited, failed,
                        "" if failed == 1 else "s")
            self._notify()

    def _wait_healthy(self, client) -> float:
        start = self._clock()
        for delay in backoff_delays(self.timeout_s):
            if client.health():
                return self._clock() - start
            if self._clock() - start >= self.timeout_s:
                break
            self._sleep(delay)
        if client.health():
            return self._clock() - start
        raise ServerGoneError(
            f"inference server {client.base_url} stopped answering and did not come back within {self.timeout_s:g} s "
            f"(vllm_server_timeout). Fix: restart it on the same address with the same flags (launch/vllm/serve.sh), "
            f"then start the run again from its last checkpoint in output_dir; or raise vllm_server_timeout if the "
            f"node needs longer to restart")

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()


class ServerGoneError(InferenceServerError):
    """A server that stopped answering did not come back within `vllm_server_timeout`."""
