"""`agent_function`: a group's episodes are calls of the user's own agent, each talking to the agent endpoint under
a model name of its own; what they sampled becomes the group. The same interface as EpisodeRunner (run_group,
score, group, release, close, stats), so the producer runs either. docs/agents.md, "Your own agent".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from asyncgrpo.config import DataSettings, LossSettings, ModelSettings
from asyncgrpo.contracts import Group, scored_advantages
from asyncgrpo.data import PromptRow
from asyncgrpo.errors import AgentFunctionError, ConfigError
from asyncgrpo.rollout.agent_endpoint import AgentEndpoint
from asyncgrpo.rollout.capture import CaptureEpisode, CaptureSettings
from asyncgrpo.rollout.episodes import ChatFormat, Episode, Latest, episode_group
from asyncgrpo.rollout.tools import load_ref

AGENT_ARGUMENTS = ("base_url", "model", "api_key")
"""What an agent function may take besides the row (it gets those of them its signature names, or all with **kwargs)."""
HTTP_CLIENT_LOGGERS = ("httpx", "httpx2", "openai")
AGENT_REWARD_COLUMN = "agent_reward"
"""The column holding a float an agent function returned, read by `agent_reward` (one more reward, weight 1)."""


def load_agent_function(ref: str) -> Callable:
    """`package.module:function` -> the function, or ConfigError naming what is missing."""
    fn = load_ref(ref, "agent_function")
    if not callable(fn):
        raise ConfigError("agent_function", f"{ref} is {type(fn).__name__}, not a function", "name a function")
    return fn


def agent_reward(prompts, completions, agent_reward, **kwargs) -> list[float | None]:
    """The float an agent function returned for each episode (None where it returned a dict)."""
    return list(agent_reward)


@dataclass
class AgentEpisode:
    """One call of the agent function: what it returned and the samples its calls made."""

    capture: CaptureEpisode
    result: Any = None

    @property
    def samples(self) -> list[Episode]:
        return [s.episode for s in self.capture.samples]

    # What the producer checks and counts over an episode's sampled ids, over all its samples:
    @property
    def ids(self) -> list[int]:
        return [t for e in self.samples for t in e.ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for e in self.samples for lp in e.logprobs]

    @property
    def loss_mask(self) -> list[int]:
        return [m for e in self.samples for m in e.loss_mask]


class CaptureStats:
    """Counters over every agent episode so far (the rollout side's stats: `capture/*`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.episodes = self.calls = self.samples = self.splits = self.truncated = 0

    def add(self, episodes: list[AgentEpisode]) -> None:
        with self._lock:
            for e in episodes:
                self.episodes += 1
                self.calls += e.capture.calls
                self.samples += len(e.samples)
                self.splits += e.capture.splits
                self.truncated += sum(s.finish_reason == "length" for s in e.samples)

    def values(self) -> dict[str, float]:
        with self._lock:
            n = max(self.episodes, 1)
            return {"capture/episodes_total": self.episodes, "capture/calls_per_episode": self.calls / n,
                    "capture/samples_per_episode": self.samples / n, "capture/new_samples_total": self.splits,
                    "capture/truncated_samples_total": self.truncated}


def call_agent(fn: Callable, row: dict, **given: Any) -> Any:
    """`fn(row, ...)` with the arguments of AGENT_ARGUMENTS it accepts; an async function is run to its end."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        kwargs = given
    else:
        names = {p.name for p in parameters}
        kwargs = {k: v for k, v in given.items() if k in names}
    out = fn(row, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


@dataclass
class AgentRunnerSettings(CaptureSettings, LossSettings, DataSettings, ModelSettings):
    """The sections the agent runner reads: its episodes' (CaptureSettings), how advantages are scaled and masked,
    whether reward_funcs score beside the agent, and lora_name (the name an agent's calls use)."""


class AgentRunner:
    """Runs a group's episodes as calls of the agent function (each on a thread of its own) against the endpoint,
    every call of an episode on the group's adapter (`episode_version: pinned`) or the newest (`latest`)."""

    def __init__(self, fmt: ChatFormat, cfg: AgentRunnerSettings, *, agent: Callable, endpoint: AgentEndpoint,
                 max_model_len: int | None):
        self.fmt, self.cfg, self.agent, self.endpoint = fmt, cfg, agent, endpoint
        self.max_model_len = max_model_len
        self.has_reward_funcs = bool(cfg.reward_funcs)
        self.stats = CaptureStats()
        for name in HTTP_CLIENT_LOGGERS:  # the agents' clients log each call at INFO: one line per turn otherwise
            logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))

    def run_group(self, client, row: PromptRow, *, n: int, adapter: str, version: int, seed: int | None,
                  latest: Latest | None = None) -> list[AgentEpisode]:
        """`n` calls of the agent function on `row`, at once. Raises the inference server's fault or TurnAborted
        if a call met one (the producer recovers and resends the group), or AgentFunctionError."""
        episodes = [AgentEpisode(CaptureEpisode(f"{self.cfg.lora_name}-episode-{uuid.uuid4().hex[:12]}", self.fmt,
                                                self.cfg, client, adapter=adapter, version=version,
                                                seed=None if seed is None else seed + j,
                                                max_model_len=self.max_model_len, latest=latest))
                    for j in range(n)]
        errors: list[tuple[int, BaseException]] = []
        data = {**row.columns, "prompt": row.prompt}

        def one(j: int) -> None:
            e = episodes[j]
            self.endpoint.register(e.capture)
            try:
                e.result = call_agent(self.agent, dict(data), base_url=self.endpoint.base_url, model=e.capture.name,
                                      api_key=self.endpoint.key or "none")
            except BaseException as exc:  # noqa: BLE001 - raised again in the group's thread
                errors.append((j, exc))
            finally:
                self.endpoint.unregister(e.capture)

        threads = [threading.Thread(target=one, args=(j,), name="agent-episode", daemon=True) for j in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fault = next((e.capture.fault for e in episodes if e.capture.fault is not None), None)
        if fault is not None:
            raise fault  # what the server did decides, not what the agent made of its error
        if errors:
            j, exc = errors[0]
            raise AgentFunctionError(f"agent_function {self.cfg.agent_function} raised {type(exc).__name__}: {exc} "
                                     f"on prompt {row.prompt!r:.200}. Fix the agent, or catch what it may meet and "
                                     f"return a reward") from exc
        for e in episodes:
            self._check(e, row)
        self.stats.add(episodes)
        return episodes

    def _check(self, e: AgentEpisode, row: PromptRow) -> None:
        where = f"agent_function {self.cfg.agent_function} on prompt {row.prompt!r:.200}"
        if not e.samples or not any(s.turns for s in e.samples):
            raise AgentFunctionError(f"{where} made no call to the endpoint that sampled anything: an episode must "
                                     f"call {self.endpoint.base_url}/chat/completions with model={e.capture.name!r} "
                                     f"(the `model` it was given) at least once")
        result = e.result
        if isinstance(result, bool) or not isinstance(result, (int, float, dict)):
            raise AgentFunctionError(f"{where} returned {result!r:.100}: return the episode's reward (a float) or a "
                                     f"dict the reward functions read")
        if isinstance(result, dict) and not self.has_reward_funcs:
            raise AgentFunctionError(f"{where} returned a dict, but no reward_funcs are configured to read it: name "
                                     f"reward functions, or return the reward as a float")
        if not isinstance(result, dict) and not math.isfinite(result):
            raise AgentFunctionError(f"{where} returned the reward {result}: it must be finite")

    def score(self, scorer, row: PromptRow, episodes: list[AgentEpisode]) -> tuple[list[float], dict[str, list]]:
        """Each episode's reward: its float, and the reward functions on its last sample's messages, with the dict
        it returned as columns (TRL's signature: `prompts[i]` that sample's first messages, `completions[i]` the
        messages after them)."""
        keys = sorted({k for e in episodes if isinstance(e.result, dict) for k in e.result})
        columns = {k: [e.result.get(k) if isinstance(e.result, dict) else None for e in episodes] for k in keys}
        columns[AGENT_REWARD_COLUMN] = [None if isinstance(e.result, dict) else float(e.result) for e in episodes]
        last = [e.samples[-1] for e in episodes]
        return scorer.score_episodes(row, [s.prompt for s in last], [s.messages for s in last],
                                     [s.ids for s in last], [s.finish_reason for s in last], None, columns=columns)

    def group(self, row: PromptRow, episodes: list[AgentEpisode], rewards: list[float], parts: dict, *, index: int,
              version: int, adapter: str) -> Group:
        """Every sample of every episode, each with its episode's reward and advantage (the advantages are the
        episodes', so an episode that made several samples weighs no more in its group's mean)."""
        owner = [i for i, e in enumerate(episodes) for _ in e.samples]
        samples = [s for e in episodes for s in e.samples]
        group = episode_group(row, samples, [rewards[i] for i in owner],
                              {k: [v[i] for i in owner] for k, v in parts.items()}, index=index, version=version,
                              adapter=adapter, cfg=self.cfg)
        advantages = scored_advantages(rewards, self.cfg.scale_rewards)
        group.advantages = [advantages[i] for i in owner]
        return group

    def release(self, episodes: list[AgentEpisode]) -> None:
        """Nothing to give back: the agent owns its tools."""

    def close(self) -> None:
        self.endpoint.close()

