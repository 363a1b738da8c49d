"""Turning one group's sampled token ids into rewards: decode, put in the form reward functions take, score.

The producer calls `score_group(row, completion_ids, finish_reasons)` on a `GroupScorer`: `InThreadScoring` here
(`reward_workers: 0`) or reward_pool.RewardPool (worker processes); rollout/build.py's make_group_scorer picks one.
Both run the same `score_group`, so they give the same rewards, and both stop a call past `reward_timeout` with
an error naming the function. This module imports neither torch nor transformers, so that a worker starts without.
"""

from __future__ import annotations

import threading
from typing import Protocol

from asyncgrpo.data import PromptRow, parse_completions
from asyncgrpo.errors import RewardFunctionError
from asyncgrpo.rewards import RewardScorer

DECODING = "decoding (tokenizer, chat form, response template)"  # the stage before the first reward function


def decode_completion(tokenizer, ids: list[int], skip_special_tokens: bool = True) -> str:
    """Token ids -> text; ids outside the tokenizer (padded vocab rows) decode to U+FFFD, so they score as wrong.
    `skip_special_tokens=False` keeps end-of-turn markers, which a response template needs to close regions."""
    size = len(tokenizer)
    pieces, run = [], []
    for i in ids:
        if i < size:
            run.append(i)
            continue
        pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        pieces.append("\ufffd")
        run = []
    pieces.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
    return "".join(pieces)


def reward_inputs(tokenizer, response_template: dict | None, row: PromptRow,
                  ids: list[list[int]]) -> tuple[list, list | None]:
    """(completions, parsed) as reward functions get them: text for a text prompt; for a chat prompt TRL's
    conversational form `[{"role": "assistant", "content": text}]`, plus the parsed messages when the tokenizer
    has a response template (None where a completion could not be parsed)."""
    texts = [decode_completion(tokenizer, i) for i in ids]
    if not row.is_chat:
        return texts, None
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    if response_template is None:
        return completions, None
    raw = [decode_completion(tokenizer, i, skip_special_tokens=False) for i in ids]
    return completions, parse_completions(tokenizer, response_template, row.rendered, raw)


def score_group(scorer: RewardScorer, tokenizer, response_template: dict | None, row: PromptRow,
                completion_ids: list[list[int]], finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
    """Decode and score one group: what both `GroupScorer`s run, in a thread or in a worker process."""
    n = len(completion_ids)
    columns = {k: [v] * n for k, v in row.columns.items()}
    completions, parsed = reward_inputs(tokenizer, response_template, row, completion_ids)
    truncated = [reason == "length" for reason in finish_reasons]  # hit max_completion_length
    return scorer.score([row.prompt] * n, completions, columns, completion_ids=completion_ids, parsed=parsed,
                        truncated=truncated)


def score_episodes(scorer: RewardScorer, row: PromptRow, prompts: list, messages: list[list[dict]],
                   completion_ids: list[list[int]], finish_reasons: list[str],
                   environments: list | None, columns: dict[str, list] | None = None) -> tuple[list[float], dict[str, list]]:
    """Score a group of episodes (docs/agents.md): as TRL, `completions[i]` is episode i's messages after its prompt
    (assistant, tool, ..., assistant), `prompts[i]` its prompt (with a reset observation), and `environments` the
    episodes' environment instances, in order, when there are any; `parsed` is each episode's last assistant
    message. `columns`: more per-episode columns (what agent functions returned)."""
    n = len(messages)
    columns = {**{k: [v] * n for k, v in row.columns.items()}, **(columns or {})}
    if environments is not None:
        columns["environments"] = environments
    parsed = [next((m for m in reversed(ms) if m.get("role") == "assistant"), None) for ms in messages]
    return scorer.score(prompts, messages, columns, completion_ids=completion_ids, parsed=parsed,
                        truncated=[reason == "length" for reason in finish_reasons])


class GroupScorer(Protocol):
    """What the producer scores with: the same call whether scoring runs in its thread or in worker processes."""

    fallbacks: int  # completions scored with reward_fallback so far (reward/fallbacks_total)

    def score_group(self, row: PromptRow, completion_ids: list[list[int]],
                    finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
        """(total reward per completion, {function name: its rewards, None where it does not apply})."""

    def at_step(self, step: int, version: int) -> None:
        """The trainer published `version` at optimizer `step`: reward functions' `trainer_state` says so from now."""

    def take_logged(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        """What reward functions logged (`log_metric`, `log_extra`) since the last call, wherever they ran."""

    def close(self) -> None:
        """Release what scoring holds (worker processes); safe to call twice."""


class InThreadScoring:
    """`reward_workers: 0`: decode and score in the training process, for the producer's request threads. With
    `timeout_s` (reward_timeout) each call runs on a thread of its own, awaited up to then: a call past it raises
    RewardFunctionError naming the function, and its thread, which nothing can stop, is left behind as a daemon.
    Without (None), the calling thread scores."""

    def __init__(self, scorer: RewardScorer, tokenizer, response_template: dict | None = None, *,
                 timeout_s: float | None = None):
        self.scorer, self.tokenizer, self.response_template = scorer, tokenizer, response_template
        self.timeout_s = timeout_s
        self._running: dict[int, str] = {}  # scoring thread id -> the stage it is in, for the timeout's message
        if timeout_s is not None:
            scorer.on_call = lambda ref: self._running.__setitem__(threading.get_ident(), ref)

    @property
    def fallbacks(self) -> int:
        return self.scorer.fallbacks

    def score_group(self, row: PromptRow, completion_ids: list[list[int]],
                    finish_reasons: list[str]) -> tuple[list[float], dict[str, list]]:
        return self._bounded(lambda: score_group(self.scorer, self.tokenizer, self.response_template, row,
                                                 completion_ids, finish_reasons), row, len(completion_ids))

    def score_episodes(self, row: PromptRow, prompts: list, messages: list[list[dict]],
                       completion_ids: list[list[int]], finish_reasons: list[str],
                       environments: list | None, columns: dict[str, list] | None = None
                       ) -> tuple[list[float], dict[str, list]]:
        """`score_episodes` under the same `reward_timeout` (episodes are scored in this process only)."""
        return self._bounded(lambda: score_episodes(self.scorer, row, prompts, messages, completion_ids,
                                                    finish_reasons, environments, columns), row, len(messages))

    def _bounded(self, run, row: PromptRow, n: int):
        """`run()` in this thread, or with `timeout_s` on a thread of its own awaited up to then."""
        if self.timeout_s is None:
            return run()
        outcome: list = []  # [result] or [None, exception], set by the scoring thread

        def scoring() -> None:
            self._running[threading.get_ident()] = DECODING
            try:
                outcome.append(run())
            except BaseException as exc:  # noqa: BLE001 - raised again in the calling thread
                outcome.extend([None, exc])
            finally:
                done.set()

        done = threading.Event()
        thread = threading.Thread(target=scoring, name="reward-scoring", daemon=True)  # daemon: may never end
        thread.start()
        if not done.wait(self.timeout_s):
            raise self._timeout_error(self._running.get(thread.ident, DECODING), row, n)
        self._running.pop(thread.ident, None)
        if len(outcome) == 2:
            raise outcome[1]
        return outcome[0]

    def at_step(self, step: int, version: int) -> None:
        self.scorer.state.global_step, self.scorer.state.policy_version = step, version

    def take_logged(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        return self.scorer.logged.take()

    def _timeout_error(self, running: str, row: PromptRow, n: int) -> RewardFunctionError:
        return reward_timeout_error(
            running, self.scorer.refs, self.timeout_s, row, n,
            "It runs in the training process (reward_workers: 0), where a thread cannot be stopped: it is left "
            "running. Fix: find where the function hangs or make it faster, raise `reward_timeout`, or set "
            "`reward_workers: 2` (worker processes: a hung one is killed and replaced)")

    def close(self) -> None:
        pass


def running_what(running: str, refs) -> str:
    """What a scoring call was running, for an error: a reward function by its reference, or the stage's name."""
    return f"reward function {running}" if running in refs else running


def reward_timeout_error(running: str, refs, timeout_s: float, row: PromptRow, n: int,
                         consequence: str) -> RewardFunctionError:
    """The error for a scoring call past `reward_timeout`; `consequence` says what became of it and the fix."""
    return RewardFunctionError(f"{running_what(running, refs)} did not finish within reward_timeout={timeout_s:g} s\n"
                               f"  on prompt {row.prompt!r} ({n} completions)\n  {consequence}")
