"""Episodes: a group's completions as multi-turn, tool-calling conversations, kept token-exact.

A turn samples on the episode's running token ids (sent to vLLM as ids), parses the sampled ids with the tokenizer's
response template, runs the tool calls (rollout/tools.py) and appends the tool messages as the chat template renders
them after a turn that ends at a stop id. Sampled ids are never re-tokenized: the trainer gets every id, a loss mask
that is 1 only on sampled ids, and per token its behaviour logprob and policy version. docs/agents.md.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from asyncgrpo.config import AgentSettings, GenerationSettings, LossSettings
from asyncgrpo.contracts import Group, scored_advantages
from asyncgrpo.data import PromptRow
from asyncgrpo.errors import ConfigError, ToolError
from asyncgrpo.rollout.scoring import decode_completion
from asyncgrpo.rollout import tool_process
from asyncgrpo.rollout.environments import EnvironmentPool, close_environment
from asyncgrpo.rollout.environments import called as _called
from asyncgrpo.rollout.inflight import InflightStats, sample_across_versions
from asyncgrpo.rollout.tool_guard import HUNG, cut_tokens
from asyncgrpo.rollout.tools import ToolResult, environment_tools, run_tool_calls, tool_schema

log = logging.getLogger(__name__)

DUMMY_USER = {"role": "user", "content": "dummy"}  # the conversation a tool suffix is rendered after (TRL's recipe)


class TurnAborted(Exception):
    """A turn's request was aborted by a sync (`sync_pause_mode: abort`): the group is lost and sent again."""


# ---- rendering and parsing ----------------------------------------------------------------------------------------
class ChatFormat:
    """One tokenizer's chat template and response template, as episodes use them: a prompt's ids (with the tools
    listed), a sampled turn parsed into a message, and the ids of tool messages that follow a sampled turn."""

    def __init__(self, tokenizer, response_template: dict | None, *, stop_ids: set[int],
                 template_kwargs: dict | None = None, system_prompt: str | None = None):
        if response_template is None:
            raise ConfigError("tools", f"the tokenizer {tokenizer.name_or_path!r} has no response_template, so tool "
                              "calls cannot be parsed from what the model samples",
                              "set `tokenizer.response_template` (transformers' response template dict; TRL's "
                              "chat_template_utils has them for Qwen3 and Gemma 4) and save the tokenizer")
        if tokenizer.chat_template is None:
            raise ConfigError("tools", f"the tokenizer {tokenizer.name_or_path!r} has no chat template",
                              "use a tokenizer whose chat template renders tool calls and tool messages")
        self.tokenizer, self.response_template = tokenizer, response_template
        self.stop_ids = set(stop_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self.system_prompt = system_prompt

    def _ids(self, messages: list[dict], schemas: list[dict], generation_prompt: bool) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=True,
                                                       return_dict=False, add_generation_prompt=generation_prompt,
                                                       **self.template_kwargs))

    def render(self, messages: list[dict], schemas: list[dict], generation_prompt: bool) -> list[int]:
        """The chat template's ids of `messages` as they are, with the tools listed (the agent endpoint's prompts)."""
        return self._ids(messages, schemas, generation_prompt)

    def prompt_ids(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        """The prompt's ids with the tools listed and the assistant turn opened (the system prompt first if the
        messages have none, as for plain chat prompts)."""
        if self.system_prompt is not None and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return self._ids(messages, schemas, True)

    def decode(self, ids: list[int]) -> str:
        return decode_completion(self.tokenizer, ids, skip_special_tokens=False)

    def parse(self, context_ids: list[int], sampled_ids: list[int], tools: list[Callable]) -> dict:
        """The assistant message of a sampled turn (`parse_response` with the running ids as prefix); one the parser
        rejects is plain text with no tool call, as TRL."""
        try:
            message = self.tokenizer.parse_response(self.decode(sampled_ids), self.response_template,
                                                    prefix=self.decode(context_ids), tools=tools or None)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.debug("parse_response failed, the turn is plain text: %s", exc)
            message = None
        if not isinstance(message, dict):
            text = decode_completion(self.tokenizer, sampled_ids)
            message = {"role": "assistant", "content": text}
        return message

    def tool_suffix(self, assistant: dict, tool_messages: list[dict], schemas: list[dict]) -> list[int]:
        """The ids that follow a sampled tool-calling turn: the tool messages and the next generation prompt. Rendered
        after a dummy [user, assistant(tool_calls)] cut after its last stop id (where the model stopped), checked to
        extend it, and the rest kept (TRL's recipe); the sampled turn itself is never rendered again."""
        dummy = [DUMMY_USER, {"role": "assistant", "content": "", "tool_calls": assistant.get("tool_calls", [])}]
        before = self._ids(dummy, schemas, False)
        stops = [i for i, t in enumerate(before) if t in self.stop_ids]
        if not stops:
            raise ToolError(f"the chat template renders an assistant tool-call turn with none of the stop ids "
                            f"{sorted(self.stop_ids)}, so where a sampled turn ends in it is unknown. Fix: give the "
                            f"tokenizer (or generation_config.json's eos_token_id) the id its turns end with")
        before = before[:stops[-1] + 1]
        after = self._ids(dummy + tool_messages, schemas, True)
        if after[:len(before)] != before:
            raise ToolError("the chat template renders the conversation differently once tool messages follow (not "
                            "prefix-preserving), so tool results cannot be appended to the sampled ids. Fix: use a "
                            "template that keeps earlier turns as they were rendered (TRL ships *_training templates)")
        return after[len(before):]


def tool_calls_of(message: dict) -> list[tuple[str, Any]]:
    """(name, arguments) of each call in a parsed assistant message."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        calls.append((str(function.get("name", "")), function.get("arguments", {})))
    return calls


# ---- one episode ---------------------------------------------------------------------------------------------------
@dataclass
class Episode:
    """One conversation of a group: its own prompt ids (a reset observation may change them), everything after them
    as ids with a loss mask, logprobs and versions per id, and the messages reward functions read."""

    prompt: list[dict]
    prompt_ids: list[int]
    tools: dict[str, Callable]
    schemas: list[dict]
    environment: Any = None
    ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"  # "length": truncated (a turn or the episode ran out of tokens)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0  # calls stopped at tool_timeout
    tool_seconds: float = 0.0

    @property
    def schemas_by_name(self) -> dict[str, dict]:
        return {s["function"]["name"]: s for s in self.schemas}

    def append(self, ids: list[int], logprobs: list[float] | None, version: int,
               versions: list[int] | None = None) -> None:
        """Sampled ids (with their logprobs) or, with None, context ids: logprob 0.0 and no loss. Each id is tagged
        `version`, or its own entry of `versions` (a turn that moved onto newer versions while it was sampled)."""
        self.ids += ids
        self.loss_mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.versions += [version] * len(ids) if versions is None else versions


class EpisodeStats:
    """Counters over every episode so far (the rollout side's stats: TensorBoard `episodes/*`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.episodes = self.turns = self.tool_calls = self.tool_errors = self.truncated = self.tokens = 0
        self.tool_timeouts = 0
        self.tool_seconds = 0.0

    def add(self, episodes: list[Episode]) -> None:
        with self._lock:
            self.episodes += len(episodes)
            for e in episodes:
                self.turns += e.turns
                self.tool_calls += e.tool_calls
                self.tool_errors += e.tool_errors
                self.tool_timeouts += e.tool_timeouts
                self.tool_seconds += e.tool_seconds
                self.tokens += len(e.ids)
                self.truncated += e.finish_reason == "length"

    def values(self) -> dict[str, float]:
        with self._lock:
            n = max(self.episodes, 1)
            return {"episodes/total": self.episodes, "episodes/turns_mean": self.turns / n,
                    "episodes/tool_calls_total": self.tool_calls, "episodes/tool_errors_total": self.tool_errors,
                    "episodes/tool_timeouts_total": self.tool_timeouts,
                    "episodes/tool_threads_hung": HUNG.hung(),  # stopped calls still blocked in C (tool_guard.py)
                    "episodes/tool_seconds_total": self.tool_seconds, "episodes/tokens_mean": self.tokens / n,
                    "episodes/truncated_total": self.truncated}


def reset_environment(environment, row: PromptRow) -> str | None:
    """TRL's `reset(**row)`: the whole dataset row (the prompt under its column name too); text it returns is
    appended to the last user message."""
    try:
        observation = _called(environment.reset(**row.columns, prompt=row.prompt))
    except Exception as exc:  # noqa: BLE001 - a user's environment: name it
        raise ToolError(f"{type(environment).__name__}.reset raised {type(exc).__name__}: {exc} on prompt "
                        f"{row.prompt!r:.200}") from exc
    return observation if isinstance(observation, str) and observation else None


Latest = Callable[[], ContextManager[tuple[int, str]]]
"""`episode_version: latest`: gives the (version, adapter) served now, held in use while its turn runs."""


@dataclass(frozen=True)
class MidTurn:
    """`inflight_weight_updates` for episodes: a turn still being sampled moves onto each new version. `served()` is
    the version served now; `stats` counts what the moves cost (rollout/inflight.py)."""

    served: Callable[[], int]
    stats: InflightStats


@dataclass
class EpisodeSettings(AgentSettings, GenerationSettings, LossSettings):
    """The sections an episode runner reads: the tools and their limits (AgentSettings), sampling and
    max_completion_length (GenerationSettings), and how a group's advantages are scaled and masked (LossSettings)."""


def process_refs(cfg: AgentSettings, names: list[str]) -> dict[str, str]:
    """{tool name: `module:function`} of the tools that run in a process of their own (`tool_process: true`),
    after checking such processes can start here; empty otherwise."""
    if not cfg.tool_process:
        return {}
    problem = tool_process.probe()
    if problem is not None:
        raise ConfigError("tool_process", f"is true, but tool processes cannot start in a namespace of their own "
                          f"here: {problem}", "allow unprivileged user namespaces (sysctl "
                          "kernel.unprivileged_userns_clone=1, or on Ubuntu "
                          "kernel.apparmor_restrict_unprivileged_userns=0), or set `tool_process: false`")
    return dict(zip(names, cfg.tools))


class EpisodeRunner:
    """Runs a group's episodes against one server: each episode on a thread of its own, its turns one request each,
    every turn on the adapter the group was sent with (`episode_version: pinned`) or on the newest served one
    (`latest`): docs/agents.md, "Versions inside an episode". Environments come from one pool: `release` the
    episodes once scored, `close` at the end of the run."""

    def __init__(self, fmt: ChatFormat, cfg: EpisodeSettings, *, tools: list[Callable], factory: Callable | None,
                 max_model_len: int | None):
        self.fmt, self.cfg, self.factory, self.max_model_len = fmt, cfg, factory, max_model_len
        self.environments = EnvironmentPool(factory, cfg.environment_factory) if factory is not None else None
        self.tools = list(tools)
        self.tool_schemas = [tool_schema(t) for t in self.tools]
        # tool_process: each `tools` function (not an environment's method) runs in a process without the keys
        self.process_refs = process_refs(cfg, [s["function"]["name"] for s in self.tool_schemas])
        self.max_episode_tokens = cfg.max_episode_tokens  # None: the server's context is the only bound
        self.stats = EpisodeStats()

    def release(self, episodes: list[Episode]) -> None:
        """The episodes' environments go back to the pool (after their rewards are computed)."""
        for e in episodes:
            if e.environment is not None and self.environments is not None:
                if e.tool_timeouts:  # a stopped call's thread may still be in it: not reused, closed
                    close_environment(e.environment)
                else:
                    self.environments.give_back(e.environment)
                e.environment = None

    def close(self) -> None:
        """Close every pooled environment (`close()` where defined): the run is over."""
        if self.environments is not None:
            self.environments.close()

    # ---- starting -------------------------------------------------------------------------------------------
    def start(self, row: PromptRow) -> Episode:
        """A fresh episode of `row`: its own environment (reset with the row), its tools and its prompt ids."""
        if not row.is_chat:
            raise ConfigError("prompt_format", f"prompt {row.prompt!r:.80} is plain text, but episodes need chat "
                              "messages (tools are listed by the chat template)", "use `prompt_format: chat`")
        messages = [dict(m) for m in row.prompt]
        tools = list(self.tools)
        environment = None
        if self.environments is not None:
            environment = self.environments.take()
            try:
                observation = reset_environment(environment, row)
            except BaseException:
                self.environments.give_back(environment)
                raise
            if observation is not None:
                last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
                messages[last]["content"] = f"{messages[last]['content']}{observation}"
            tools += environment_tools(environment)
        schemas = self.tool_schemas + [tool_schema(t, "environment_factory") for t in tools[len(self.tools):]]
        by_name = {s["function"]["name"]: t for s, t in zip(schemas, tools)}
        return Episode(prompt=messages, prompt_ids=self.fmt.prompt_ids(messages, schemas), tools=by_name,
                       schemas=schemas, environment=environment)

    # ---- running --------------------------------------------------------------------------------------------
    def run_group(self, client, row: PromptRow, *, n: int, adapter: str, version: int,
                  seed: int | None, latest: Latest | None = None, mid_turn: MidTurn | None = None) -> list[Episode]:
        """`n` episodes of `row`, all turns on `adapter`, or each on what `latest()` gives (and, with `mid_turn`,
        moved onto each new version while it is sampled). Raises what a turn's request raised (the producer loses
        and resends the group on a server fault) or TurnAborted."""
        episodes: list[Episode] = []
        try:
            for _ in range(n):
                episodes.append(self.start(row))
            return self._run_all(client, row, episodes, adapter=adapter, version=version, seed=seed, latest=latest,
                                 mid_turn=mid_turn)
        except BaseException:
            self.release(episodes)  # the group is lost: its environments are reset before their next use
            raise

    def _run_all(self, client, row: PromptRow, episodes: list[Episode], *, adapter: str, version: int,
                 seed: int | None, latest: Latest | None, mid_turn: MidTurn | None) -> list[Episode]:
        n = len(episodes)
        errors: list[BaseException] = []

        def one(j: int) -> None:
            try:
                self.run(client, episodes[j], adapter=adapter, version=version,
                         seed=None if seed is None else seed + j, latest=latest, mid_turn=mid_turn)
            except BaseException as exc:  # noqa: BLE001 - raised again in the group's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(j,), name="episode", daemon=True) for j in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        self.stats.add(episodes)
        return episodes

    def _left(self, e: Episode, more: int = 0) -> int | None:
        """Tokens the episode may still add after `more` further ones: its own budget and the server's context
        (None: unbounded)."""
        left = [] if self.max_episode_tokens is None else [self.max_episode_tokens - len(e.ids) - more]
        if self.max_model_len is not None:
            left.append(self.max_model_len - len(e.prompt_ids) - len(e.ids) - more)
        return min(left) if left else None

    def _room(self, e: Episode) -> int:
        """Tokens the next turn may sample: the turn's budget (max_completion_length) within the episode's."""
        left = self._left(e)
        return self.cfg.max_completion_length if left is None else min(self.cfg.max_completion_length, left)

    def run(self, client, e: Episode, *, adapter: str, version: int, seed: int | None,
            latest: Latest | None = None, mid_turn: MidTurn | None = None) -> None:
        """One episode, turn after turn, until it answers without a tool call, its environment is done, `max_turns`
        or a token budget is reached. Each turn on `adapter` (pinned) or on what `latest()` gives then; with
        `mid_turn` (which needs `latest`), a turn still being sampled when a new version is served goes on from its
        tokens on that version."""
        cfg = self.cfg
        assert mid_turn is None or latest is not None, "a turn moves onto the version `latest` gives"
        while True:
            room = self._room(e)
            if room < 1:
                e.finish_reason = "length"
                return
            turn_seed = None if seed is None else (seed + 7919 * e.turns) % 2**31
            policy = contextlib.nullcontext((version, adapter)) if latest is None else latest()
            with policy as (turn_version, turn_adapter):  # the turn's adapter stays loaded until its answer is in
                if mid_turn is None:
                    (c,) = client.complete(turn_adapter, e.prompt_ids + e.ids, n=1, max_tokens=room,
                                           temperature=cfg.temperature, top_p=cfg.top_p, seed=turn_seed)
                else:  # a sampled turn that ends as the server would have ended it (an abort is continued)
                    (c,) = sample_across_versions(client, e.prompt_ids + e.ids, n=1, max_tokens=room,
                                                  first=(turn_version, turn_adapter), policy=latest,
                                                  served=mid_turn.served, stats=mid_turn.stats,
                                                  temperature=cfg.temperature, top_p=cfg.top_p, seed=turn_seed)
            if c.finish_reason == "abort":
                raise TurnAborted(f"turn {e.turns + 1} was aborted by a sync")
            context = e.prompt_ids + e.ids
            turn_versions = getattr(c, "versions", None)  # per token, when the turn could move
            e.append(c.token_ids, c.logprobs, turn_version, versions=turn_versions)
            if turn_versions:
                turn_version = turn_versions[-1]  # the tool suffix (context, no loss) is tagged as the turn ended
            e.turns += 1
            message = self.fmt.parse(context, c.token_ids, list(e.tools.values()))
            e.messages.append(message)
            if c.finish_reason == "length":
                e.finish_reason = "length"  # the turn ran out of tokens: its tool calls, if any, are cut off
                return
            calls = tool_calls_of(message)
            if not calls or e.turns >= cfg.max_turns:
                return
            results = run_tool_calls(e.tools, calls, cfg.tool_timeout, schemas=e.schemas_by_name,
                                     max_chars=cfg.tool_output_max_chars, max_calls=cfg.max_tool_calls_per_turn,
                                     process_refs=self.process_refs)
            self._count(e, results)
            tool_messages = [{"role": "tool", "name": r.name,
                              "content": cut_tokens(r.content, self.fmt.tokenizer, cfg.tool_output_max_tokens)}
                             for r in results]
            e.messages += tool_messages
            if e.environment is not None and getattr(e.environment, "done", False):
                return  # the environment says the episode is over
            suffix = self.fmt.tool_suffix(message, tool_messages, e.schemas)
            left = self._left(e, len(suffix))
            if left is not None and left < 1:
                e.finish_reason = "length"  # no room for the results and one more token: truncated here (TRL)
                return
            e.append(suffix, None, turn_version)

    def score(self, scorer, row: PromptRow, episodes: list[Episode]) -> tuple[list[float], dict[str, list]]:
        """The group's rewards (rollout/scoring.py's score_episodes, TRL's signature), environments included."""
        environments = [e.environment for e in episodes] if self.cfg.environment_factory else None
        return scorer.score_episodes(row, [e.prompt for e in episodes], [e.messages for e in episodes],
                                     [e.ids for e in episodes], [e.finish_reason for e in episodes], environments)

    def group(self, row: PromptRow, episodes: list[Episode], rewards: list[float], parts: dict, *, index: int,
              version: int, adapter: str) -> Group:
        return episode_group(row, episodes, rewards, parts, index=index, version=version, adapter=adapter,
                             cfg=self.cfg)

    @staticmethod
    def _count(e: Episode, results: list[ToolResult]) -> None:
        e.tool_calls += len(results)
        e.tool_errors += sum(r.error for r in results)
        e.tool_timeouts += sum(r.timed_out for r in results)
        e.tool_seconds += sum(r.seconds for r in results)


# ---- a scored group ------------------------------------------------------------------------------------------------
def common_prefix(sequences: list[list[int]]) -> int:
    """Length of the longest prefix every sequence shares."""
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


def episode_group(row: PromptRow, episodes: list[Episode], rewards: list[float], parts: dict, *, index: int,
                  version: int, adapter: str, cfg: LossSettings) -> Group:
    """The group the trainer gets: the prompt ids every episode shares, then per episode the rest of its own prompt
    (a reset observation; context) and its ids, with loss mask, logprobs and versions. Its `version` is its oldest
    sampled token's (`version`, the one it was sent with, when all turns were pinned to it or nothing was sampled),
    so that `max_staleness` bounds every token of it."""
    version = min((v for e in episodes for v, m in zip(e.versions, e.loss_mask) if m), default=version)
    shared = common_prefix([e.prompt_ids for e in episodes])
    completions, masks, logprobs, versions = [], [], [], []
    for e in episodes:
        own = e.prompt_ids[shared:]
        completions.append(own + e.ids)
        masks.append([0] * len(own) + e.loss_mask)
        logprobs.append([0.0] * len(own) + e.logprobs)
        versions.append([version] * len(own) + e.versions)
    finish = [e.finish_reason for e in episodes]
    return Group(prompt=row.rendered or row.prompt, prompt_ids=episodes[0].prompt_ids[:shared],
                 completion_ids=completions, behaviour_logprobs=logprobs, rewards=rewards, reward_parts=parts,
                 advantages=scored_advantages(rewards, cfg.scale_rewards), version=version, adapter=adapter,
                 finish_reasons=finish, index=index,
                 masked=[f == "length" for f in finish] if cfg.mask_truncated_completions else [],
                 loss_mask=masks, versions=versions)


def environment_reward(prompts, completions, environments, **kwargs) -> list[float | None]:
    """An environment's own `get_reward()` as a reward function (TRL: named after the class, weight 1)."""
    return [_called(e.get_reward()) for e in environments]
