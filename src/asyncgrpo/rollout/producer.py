"""RolloutProducer: on rank 0, in the background, keeps generation requests in flight and fills the queue.

What may be sent, for which batch, at which version is the Admission's (rollout/admission.py); each request
goes to the least-loaded server that is up (rollout/server_pool.py). A request lost to a server fault or a sync's abort
is counted and its prompt sent again before any new one, while inference/recovery.py brings the server back. The
first failure stops the producer and reaches the trainer through the queue. Fault rules: docs/rollout-internals.md.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import SimpleNamespace

from asyncgrpo.config import AgentSettings, GenerationSettings, LossSettings
from asyncgrpo.data import PromptRow, PromptStream
from asyncgrpo.errors import AdapterNotLoadedError, BehaviourLogprobError, InferenceServerError, ServerUnreachableError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference.recovery import ServerRecovery
from asyncgrpo.timeline import Timeline
from asyncgrpo.contracts import Group, finish_reason_from_tokens, scored_advantages
from asyncgrpo.rollout.episodes import EpisodeRunner, MidTurn, TurnAborted
from asyncgrpo.rollout.inflight import InflightStats, sample_across_versions
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.admission import Admission, AdmissionSettings
from asyncgrpo.rollout.concurrency import InflightControl
from asyncgrpo.rollout.scoring import GroupScorer
from asyncgrpo.rollout.server_pool import ServerPicker

log = logging.getLogger(__name__)

STOP_PROCESSING_S = 30.0  # stop() waits this long at most for answers being scored (reward functions run there)


# The lowest logprob a sampled token may have. Below about -745 even float64 rounds the probability to exactly 0, so
# no sampler can have drawn such a token; vLLM writes -9999.0 where a logprob is -inf (JSON has no infinity). A
# token between -1000 and, say, -100 is only astronomically unlikely: it passes here, and the loss clamps its ratio.
BEHAVIOUR_LOGPROB_FLOOR = -1000.0


def check_behaviour_logprobs(completions, *, server: str, prompt_index: int, adapter: str) -> None:
    """Refuse a server answer whose sampled-token logprobs are NaN, infinite or below BEHAVIOUR_LOGPROB_FLOOR,
    naming the server, the request and the token."""
    for i, c in enumerate(completions):
        if not c.logprobs or (math.isfinite(sum(c.logprobs)) and min(c.logprobs) >= BEHAVIOUR_LOGPROB_FLOOR):
            continue  # all finite (a NaN or an infinity makes the sum one) and above the floor: no token to name
        for t, lp in enumerate(c.logprobs):
            if not math.isfinite(lp) or lp < BEHAVIOUR_LOGPROB_FLOOR:
                raise BehaviourLogprobError(
                    f"{server} returned logprob {lp} for token {t} (id {c.token_ids[t]}) of completion {i} of the "
                    f"request for prompt {prompt_index} (adapter {adapter!r}): no sampled token can have it (the "
                    f"floor is {BEHAVIOUR_LOGPROB_FLOOR}). Fix: serve in float32 or bfloat16 rather than float16 "
                    f"(overflow), with `--logprobs-mode processed_logprobs`, and check the adapter loaded correctly")


def request_seed(seed: int, index: int, n: int) -> int:
    """The sampling seed of the request for the prompt at stream position `index`. vLLM seeds the i-th of the `n`
    completions with seed + i, so seeds are spaced `n` apart: no two completions of a run share a random stream."""
    return (seed * 1_000_003 + index * n) % 2**31


@dataclass
class ProducerSettings(AdmissionSettings, GenerationSettings, LossSettings, AgentSettings):
    """The sections the producer reads: its send rule's (AdmissionSettings: staleness, the sync and rollout modes,
    num_iterations, seed), sampling (GenerationSettings), how advantages are scaled and masked (LossSettings), and
    which version an episode's later turns use (AgentSettings)."""


class RolloutProducer:
    """Background generation + scoring. Call `start()`, then `set_policy()` after every publish, `stop()` at the end.
    `start_batch`: the index of the first batch to fill (a resumed run continues at its checkpoint's batch). Build
    one with rollout.build.build_producer, which connects its admission to `queue` and `recovery`."""

    def __init__(self, *, clients: list[InferenceClient], rows: list[PromptRow], scorer: GroupScorer,
                 queue: RolloutQueue, groups_per_step: int, cfg: ProducerSettings, max_inflight: int,
                 recovery: ServerRecovery, inflight_ceiling: int | None = None, start_position: int = 0,
                 start_batch: int = 0, end_token_ids: frozenset[int] = frozenset(),
                 episodes: EpisodeRunner | None = None):
        self._clients = list(clients)
        self.end_token_ids = end_token_ids  # the tokens a completion ends on: it is truncated if its last is not one
        self.servers = ServerPicker(clients)  # requests in flight per server: the next goes to the least loaded
        # A server that stops answering is recovered in the background (re-registered before it gets requests again)
        self.recovery = recovery
        # Its send rule also hears from `recovery` (a server down or back) and `queue` (groups that left it):
        # rollout/build.py's build_producer connects them.
        self.admission = Admission(cfg, groups_per_step, max_inflight,
                                        servers_up=lambda: any(self.recovery.is_up(c) for c in self._clients),
                                        batches_taken=start_batch)
        # adaptive_inflight (`inflight_ceiling` given): the admission's cap moves after every batch taken, up to it
        self.control = None if inflight_ceiling is None else InflightControl(max_inflight, servers=len(clients),
                                                                             ceiling=inflight_ceiling)
        self._adapting = threading.Lock()  # one update at a time; a batch taken during one skips its own
        self.scorer = scorer  # decodes and scores a group: in the request thread, or in reward worker processes
        self.episodes = episodes  # with tools/environment_factory: completions are multi-turn episodes
        self.queue = queue
        self.groups_per_step = groups_per_step
        self.cfg = cfg
        self.stream = PromptStream(rows, cfg.seed, start=start_position)  # a resumed run starts where it stopped
        self._lock = threading.Condition()  # guards the producer's own state below (admission has its own lock)
        self._resend: deque[tuple[PromptRow, int]] = deque()  # prompts whose generation was lost: sent first
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self.error: BaseException | None = None  # the failure that stopped the producer, if one did
        self._processing = 0  # answers being scored now (stop() waits for these, not for requests in flight)
        self._local = threading.local()
        self._forgot_at: dict[str, int] = {}  # server -> epoch at which it last forgot an adapter, until a success
        # statistics, read by the trainer for logging
        self.generated_tokens = 0
        self.lost_groups = 0
        self.resent_groups = 0
        self.inflight_stats = InflightStats()  # with inflight_weight_updates: completions moved onto new versions
        self.started_at = time.monotonic()
        self.server_busy = Timeline()  # intervals with at least one generation request in flight

    # ---- control ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def set_policy(self, version: int, adapter: str) -> None:
        """The server now serves `adapter` as policy `version`; requests sent from now on are tagged with it."""
        self.admission.set_policy(version, adapter)

    def adapt_inflight(self, trainer_waited: bool) -> None:
        """After a batch was taken (adaptive_inflight): read the servers' load and move the cap on requests in flight
        (rollout/concurrency.py), in a thread of its own so that the trainer does not wait for the servers' answers."""
        if self.control is None or not self._adapting.acquire(blocking=False):
            return
        threading.Thread(target=self._adapt, args=(trainer_waited,), name="inflight-control", daemon=True).start()

    def _adapt(self, trainer_waited: bool) -> None:
        try:
            loads = [c.server_load() for c in self._clients if self.recovery.is_up(c)]
            before = self.admission.max_inflight
            after = self.admission.set_limit(
                lambda reached: self.control.update(loads, trainer_waited=trainer_waited, limit_reached=reached))
            if after != before:
                log.info("requests in flight: %d -> %d (%s)", before, after, self.control.last_reason)
        finally:
            self._adapting.release()

    def stop(self) -> None:
        """Send nothing more; requests in flight are abandoned (their daemon threads end with their HTTP call, or
        with the process), not waited for."""
        self.admission.stop()
        with self._lock:
            self._stop = True
            # Answers being scored finish (CPU work, short); requests still waiting on a server are not waited for.
            self._lock.wait_for(lambda: self._processing == 0, timeout=STOP_PROCESSING_S)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)  # the scheduler only waits on the admission's condition: it returns at once
        self.scorer.close()  # reward worker processes, if any

    def _fail(self, exc: BaseException) -> None:
        """The first failure stops the producer (nothing more is sent) and goes to the trainer; later ones, often
        the same fault seen by other requests, are only logged at debug level."""
        with self._lock:
            first = self.error is None and not self._stop
            if first:
                self.error = exc
            self._stop = True
        self.admission.stop()
        if first:
            log.error("rollout failed, no more requests are sent: %s", exc)
            self.queue.fail(exc)
        else:
            log.debug("after the producer stopped: %s", exc)

    @property
    def inflight(self) -> int:
        return self.admission.inflight

    @property
    def max_inflight(self) -> int:
        return self.admission.max_inflight  # request threads alive at once, at most

    def inflight_per_server(self) -> dict[str, int]:
        """Requests in flight on each server, by URL."""
        with self._lock:
            return self.servers.inflight_per_server()

    def sent_per_server(self) -> dict[str, int]:
        """Requests sent to each server so far, by URL."""
        with self._lock:
            return self.servers.sent_per_server()

    def adapters_in_use(self) -> set[str]:
        """Adapter names that requests in flight were sent to (they must stay loaded)."""
        return self.admission.adapters_in_use()

    # ---- scheduling ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                claimed = self.admission.claim()  # blocks until admission lets one more request go
                if claimed is None:
                    return  # stopped
                version, adapter = claimed
                with self._lock:
                    client = self.servers.pick(self.recovery.is_up)
                    prompt = self._resend.popleft() if self._resend else None  # (row, index) of a lost group
                    self.resent_groups += prompt is not None
                if prompt is None:
                    index = self.stream.position  # the prompt's place in the data order: its group's `index`
                    prompt = next(self.stream), index
                threading.Thread(target=self._make_group, args=(client, *prompt, version, adapter),
                                 name="rollout-request", daemon=True).start()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which re-raises it
            self._fail(exc)

    # ---- one request ----------------------------------------------------------------------------------
    def _make_group(self, client: InferenceClient, row: PromptRow, index: int, version: int, adapter: str) -> None:
        try:
            seen = self.recovery.epoch(client)
            try:
                group = self._generate(client, row, index, version, adapter)
            except ServerUnreachableError as exc:
                self._lose_group(row, index)
                self._recover_in_background(client, seen, exc)
                return
            except AdapterNotLoadedError as exc:
                self._adapter_missing(client, seen, adapter, exc)  # raises if this is not a restart
                self._lose_group(row, index)
                self._recover_in_background(client, seen, exc)
                return
            with self._lock:
                self._forgot_at.pop(client.base_url, None)  # it served a request: a later 404 is a new restart
            if group is not None and not self._stop:
                self.queue.put(group)
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
        finally:
            self.admission.finished(adapter)
            with self._lock:
                self.servers.done(client)
                if getattr(self._local, "processing", False):
                    self._local.processing = False
                    self._processing -= 1
                    self._lock.notify_all()

    def _begin_processing(self) -> bool:
        """A request's answer came: False if the producer has stopped (drop it). Else it counts as being processed
        until `_make_group` ends, and `stop()` waits for it: scoring runs torch, which must not still run in a daemon
        thread while the interpreter exits (C++ terminate). Requests still waiting for an answer are not waited for."""
        with self._lock:
            if self._stop:
                return False
            self._processing += 1
            self._local.processing = True
            return True

    def _lose_group(self, row: PromptRow, index: int) -> None:
        """This prompt's generation is lost: count it, and queue the prompt to be sent again before any new one."""
        with self._lock:
            self.lost_groups += 1
            self._resend.append((row, index))
        self.admission.lost()  # after the prompt is queued to be resent: the freed slot goes to it

    def _adapter_missing(self, client: InferenceClient, seen_epoch: int, adapter: str,
                         exc: AdapterNotLoadedError) -> None:
        """`client`'s server answered that `adapter` does not exist. If it was marked down or recovered since the
        request was sent, the request met it restarting: recovery registers the adapter. If not, it restarted
        unseen (between requests), and a recovery is needed (recorded as the epoch it forgot at). But if it forgets
        again on the first request after that recovery registered the adapter, with nothing served in between, the
        requests and the registrations are not reaching the same vLLM: raise, naming the likely cause."""
        url = client.base_url
        with self._lock:
            if self.recovery.epoch(client) != seen_epoch or not self.recovery.is_up(client):
                return
            if self._forgot_at.get(url) == seen_epoch - 1:
                raise InferenceServerError(
                    f"{exc}. {url} says {adapter} does not exist right after it was registered on it again (nothing "
                    f"was served in between): the requests and the adapter loads are not reaching the same vLLM "
                    f"server. Fix: if {url} is a load balancer or a service over several vLLM servers, list each "
                    f"server in vllm_server_base_url instead", status=exc.status, body=exc.body) from exc
            self._forgot_at[url] = seen_epoch

    def _recover_in_background(self, client: InferenceClient, seen_epoch: int, exc: InferenceServerError) -> None:
        """The server died (or restarted) under a request: recover it in the background, so that the other servers
        keep generating meanwhile."""
        if self._stop:
            return
        # Debug only: every request in flight fails with its server; ServerRecovery logs the outage once, with a count.
        log.debug("rollout request to %s lost (%d groups lost so far; the prompt is sent again): %s",
                  client.base_url, self.lost_groups, exc)
        threading.Thread(target=self._recover, args=(client, seen_epoch, exc), name="recover-server",
                         daemon=True).start()

    def _recover(self, client: InferenceClient, seen_epoch: int, exc: BaseException) -> None:
        try:
            self.recovery.recover(client, seen_epoch, cause=exc)
        except BaseException as error:  # noqa: BLE001 - the server is gone: the trainer re-raises it
            self._fail(error)

    def _generate(self, client: InferenceClient, row: PromptRow, index: int, version: int,
                  adapter: str) -> Group | None:
        cfg = self.cfg
        seed = request_seed(cfg.seed, index, cfg.num_generations) if cfg.seeded_generation else None
        if self.episodes is not None:
            return self._generate_episodes(client, row, index, version, adapter, seed)
        self.server_busy.enter()
        try:
            if cfg.inflight_weight_updates:
                completions = self._sample_across_versions(client, row, version, adapter, seed)
            else:
                completions = client.complete(adapter, row.prompt_ids, n=cfg.num_generations,
                                              max_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                              top_p=cfg.top_p, seed=seed)
        finally:
            self.server_busy.exit()
        if not self._begin_processing():
            return None  # stopped while the request ran: its answer is dropped
        if any(c.finish_reason == "abort" for c in completions):
            self._lose_group(row, index)  # aborted by a sync with sync_pause_mode: abort
            return None
        check_behaviour_logprobs(completions, server=client.base_url, prompt_index=index, adapter=adapter)
        self.generated_tokens += sum(len(c.token_ids) for c in completions)
        # Truncated: cut off at max_completion_length, read from the tokens (an EOS as the last allowed token is not).
        reasons = [finish_reason_from_tokens(c.finish_reason, c.token_ids, self.end_token_ids) for c in completions]
        truncated = [reason == "length" for reason in reasons]
        rewards, parts = self.scorer.score_group(row, [c.token_ids for c in completions], reasons)
        advantages = scored_advantages(rewards, cfg.scale_rewards)
        versions = [c.versions for c in completions] if cfg.inflight_weight_updates else []
        # As old as its oldest sampled token (the version it was sent with when nothing was sampled): max_staleness
        # then bounds every token of it.
        oldest = min((v[0] for v in versions if v), default=version)
        return Group(prompt=row.rendered or row.prompt, prompt_ids=row.prompt_ids,
                     completion_ids=[c.token_ids for c in completions],
                     behaviour_logprobs=[c.logprobs for c in completions],
                     rewards=rewards, reward_parts=parts, advantages=advantages, version=oldest, adapter=adapter,
                     finish_reasons=reasons, index=index,
                     masked=truncated if cfg.mask_truncated_completions else [], versions=versions)

    def _sample_across_versions(self, client: InferenceClient, row: PromptRow, version: int, adapter: str,
                                seed: int | None) -> list:
        """`num_generations` completions that move onto each version published while they are sampled
        (rollout/inflight.py); a continuation is not seeded (its randomness cannot be replayed anyway)."""
        cfg = self.cfg
        return sample_across_versions(client, row.prompt_ids, n=cfg.num_generations,
                                      max_tokens=cfg.max_completion_length, first=(version, adapter),
                                      policy=self.admission.latest, served=lambda: self.admission.version,
                                      stats=self.inflight_stats, temperature=cfg.temperature, top_p=cfg.top_p,
                                      seed=seed)

    def _generate_episodes(self, client: InferenceClient, row: PromptRow, index: int, version: int, adapter: str,
                           seed: int | None) -> Group | None:
        """`_generate` for episodes (rollout/episodes.py, or the agent function's: rollout/agent_runner.py): every
        turn of the group's episodes on `adapter`, or on the newest served one with `episode_version: latest`."""
        latest = self.admission.latest if self.cfg.episode_version == "latest" else None
        # Turns moved mid-generation (inflight_weight_updates): tools and environments only; an agent function's
        # calls are refused that option by the config.
        moves = {"mid_turn": MidTurn(served=lambda: self.admission.version, stats=self.inflight_stats)} \
            if self.cfg.inflight_weight_updates else {}
        self.server_busy.enter()
        try:
            episodes = self.episodes.run_group(client, row, n=self.cfg.num_generations, adapter=adapter,
                                               version=version, seed=seed, latest=latest, **moves)
        except TurnAborted:
            episodes = None
        finally:
            self.server_busy.exit()
        try:
            if not self._begin_processing():
                return None
            if episodes is None:
                self._lose_group(row, index)  # a turn was aborted by a sync with sync_pause_mode: abort
                return None
            check_behaviour_logprobs([SimpleNamespace(token_ids=e.ids, logprobs=e.logprobs) for e in episodes],
                                     server=client.base_url, prompt_index=index, adapter=adapter)
            self.generated_tokens += sum(sum(e.loss_mask) for e in episodes)
            rewards, parts = self.episodes.score(self.scorer, row, episodes)
            return self.episodes.group(row, episodes, rewards, parts, index=index, version=version, adapter=adapter)
        finally:
            self.episodes.release(episodes or [])  # scored (or dropped): the environments are reused
