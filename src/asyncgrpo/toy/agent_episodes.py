"""Episodes of the toy agent world in plain PyTorch: the warm-up's supervised episodes and `heldout_success`.

`warmup_batch` draws episodes over fresh random chains (so the model learns the format and when to stop calling,
not the world's table) with deliberate mistakes, and renders them with the chat template, loss on assistant tokens
only.
`heldout_success` plays episodes with HF `generate` and `LookupEnv`, continuing each turn on the sampled ids.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.toy.agent_chat import render_ids, tool_suffix_ids
from asyncgrpo.toy.agent_task import (HOP_WEIGHTS, KEY_MARK, KEYS, LookupEnv, draw_value, final_answer,
                                      lookup_text, question_text)

MAX_LOOKUPS = len(HOP_WEIGHTS)
"""Warm-up episodes make at most this many calls, so 5 turns (4 calls + the answer) always suffice."""

CONTEXT = 256
"""The toy model's positions: an episode stops (truncated) when its next turn could not fit."""

CALL: dict[str, Any] = {"role": "assistant", "content": "",
                        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}
"""The assistant turn `@lookup()`."""


def warmup_episode(rng: random.Random, stop_early_prob: float, guess_prob: float) -> list[dict[str, Any]]:
    """One supervised episode on a fresh chain of 1-4 hops: `@lookup()` while the tool returns a key, then the value
    as the answer. Mistakes on purpose: before each call the episode stops with `stop_early_prob` and answers the
    last key it read or a guessed value (a guess before the first call); having read the value, it answers a guessed
    value instead with `guess_prob`."""
    hops = rng.choices(range(1, MAX_LOOKUPS + 1), weights=HOP_WEIGHTS)[0]
    chain = [*rng.sample(KEYS, hops), draw_value(rng)]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question_text(chain[0])}]
    for entry in chain[1:]:
        if rng.random() < stop_early_prob:  # answer now: the last key read (half the time) or a guess
            read = messages[-1]["content"].removeprefix(KEY_MARK) if len(messages) > 1 else None
            answer = read if read is not None and rng.random() < 0.5 else draw_value(rng)
            return [*messages, {"role": "assistant", "content": answer}]
        messages += [CALL, {"role": "tool", "name": "lookup", "content": lookup_text(entry)}]
    answer = draw_value(rng) if rng.random() < guess_prob else chain[-1]
    return [*messages, {"role": "assistant", "content": answer}]


def assistant_labels(tokenizer: Any, ids: list[int]) -> list[int]:
    """Labels for rendered ids: the id itself inside assistant turns (after `<|im_start|>assistant\\n`, through
    the turn's `<|im_end|>`), -100 elsewhere (system, user and tool turns, and the generation prompts)."""
    opener = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    labels = [-100] * len(ids)
    i = 0
    while i < len(ids):
        if ids[i : i + len(opener)] == opener:
            i += len(opener)
            while i < len(ids):
                labels[i] = ids[i]
                i += 1
                if ids[i - 1] == end:
                    break
        else:
            i += 1
    return labels


def warmup_batch(tokenizer: Any, rng: random.Random, size: int, stop_early_prob: float,
                 guess_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` rendered warm-up episodes, right-padded: (inputs, labels), both (B, L); labels are -100 outside
    assistant turns and on padding."""
    tools = [LookupEnv().lookup]
    sequences = [render_ids(tokenizer, warmup_episode(rng, stop_early_prob, guess_prob), tools)
                 for _ in range(size)]
    length = max(map(len, sequences))
    assert length <= CONTEXT, f"a warm-up episode of {length} tokens does not fit the toy model's {CONTEXT}"
    inputs = torch.full((size, length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, length), -100, dtype=torch.long)
    for i, ids in enumerate(sequences):
        inputs[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(assistant_labels(tokenizer, ids))
    return inputs, labels


@dataclass
class AgentEval:
    """What a set of episodes did (means are per episode)."""

    success: float
    """Fraction of episodes whose final answer is the row's answer."""
    turns_mean: float
    """Model turns per episode."""
    tool_calls_mean: float
    """Tool calls per episode."""
    tool_errors: int
    """Tool calls that failed (a call after the chain's end, a tool that does not exist, arguments it lacks)."""
    truncated: int
    """Episodes cut off: a turn without `<|im_end|>`, or no room left in the model's context."""


@dataclass
class _Episode:
    row: dict[str, Any]
    env: LookupEnv
    ids: list[int]
    messages: list[dict[str, Any]]
    done: bool = False
    truncated: bool = False
    errors: int = 0


def tool_error(message: str) -> str:
    """A failed call's tool message, as the episode runner writes it (TRL's `{"error": ...}`)."""
    return json.dumps({"error": message}, ensure_ascii=False)


def _run_tools(episode: _Episode, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages for `calls`; a call of a tool that raises, does not exist or has non-object arguments reads
    `{"error": ...}` with the episode runner's wording (rollout/tools.py)."""
    messages = []
    for call in calls:
        function = call.get("function", call)
        name, arguments = function.get("name"), function.get("arguments", {})
        content, failed = "", True
        if name != "lookup":
            content = tool_error(f"no tool named {name!r}; tools: ['lookup']")
        elif not isinstance(arguments, dict):
            content = tool_error(f"arguments of {name} must be an object, got {arguments!r:.200}")
        else:
            try:
                content, failed = str(episode.env.lookup(**arguments)), False
            except Exception as exc:  # noqa: BLE001 - the model reads it, as from the episode runner
                content = tool_error(f"{type(exc).__name__}: {exc}")
        episode.errors += failed
        messages.append({"role": "tool", "name": name, "content": content})
    return messages


def _turn(model: torch.nn.Module, tokenizer: Any, active: list[_Episode], tools: list[Any],
          max_new_tokens: int, sample: bool) -> None:
    """One model turn of every active episode (left-padded into one generate call), then its tool calls."""
    eos = tokenizer.eos_token_id
    width = max(len(e.ids) for e in active)
    inputs = torch.full((len(active), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(inputs)
    for i, e in enumerate(active):
        inputs[i, width - len(e.ids):], mask[i, width - len(e.ids):] = torch.tensor(e.ids), 1
    out = model.generate(input_ids=inputs, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=sample,
                         temperature=1.0 if sample else None, top_k=0 if sample else None,
                         top_p=1.0 if sample else None, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    for e, new in zip(active, out[:, width:].tolist()):
        if eos not in new:  # ran out of tokens mid-turn
            e.done = e.truncated = True
            e.messages.append({"role": "assistant", "content": tokenizer.decode(new)})
            continue
        new = new[: new.index(eos) + 1]
        try:
            message = tokenizer.parse_response(new, prefix=tokenizer.decode(e.ids), tools=tools)
        except ValueError:  # malformed call: the turn stands as plain text and the episode ends
            message = {"role": "assistant", "content": tokenizer.decode(new[:-1])}
        e.ids += new
        e.messages.append(message)
        if not message.get("tool_calls"):
            e.done = True
            continue
        results = _run_tools(e, message["tool_calls"])
        e.messages += results
        e.ids += tool_suffix_ids(tokenizer, results, tools)


@torch.no_grad()
def run_episodes(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], *, seed: int | None = None,
                 max_turns: int = 5, max_new_tokens: int = 20) -> list[dict[str, Any]]:
    """Play one episode per row: greedy, or sampled at temperature 1 when `seed` is given (the same seed gives the
    same episodes). Returns per row `{"messages", "ids", "errors", "truncated"}`; `messages` is the completion
    (what a reward function receives), `ids` the whole token list the model saw and wrote."""
    tools = [LookupEnv().lookup]
    episodes = []
    for row in rows:
        env = LookupEnv()
        env.reset(**row)
        ids = render_ids(tokenizer, row["prompt"], tools, add_generation_prompt=True)
        episodes.append(_Episode(row, env, ids, []))
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed if seed is not None else 0)
        for _ in range(max_turns):
            for e in episodes:
                if not e.done and len(e.ids) + max_new_tokens > CONTEXT:
                    e.done = e.truncated = True
            active = [e for e in episodes if not e.done]
            if not active:
                break
            _turn(model, tokenizer, active, tools, max_new_tokens, sample=seed is not None)
    model.train(was_training)
    return [{"messages": e.messages, "ids": e.ids, "errors": e.errors, "truncated": e.truncated} for e in episodes]


def heldout_success(model: torch.nn.Module, tokenizer: Any, rows: list[dict[str, Any]], *,
                    seed: int | None = None, max_turns: int = 5) -> AgentEval:
    """Episode figures of `model` on `rows`: greedy, or sampled at temperature 1 from `seed`."""
    episodes = run_episodes(model, tokenizer, rows, seed=seed, max_turns=max_turns)
    answers = [final_answer(e["messages"]) for e in episodes]
    wins = [a is not None and a.strip() == r["answer"] for a, r in zip(answers, rows)]
    turns = [sum(m["role"] == "assistant" for m in e["messages"]) for e in episodes]
    calls = [sum(len(m.get("tool_calls") or []) for m in e["messages"]) for e in episodes]
    n = max(1, len(rows))
    return AgentEval(success=sum(wins) / n, turns_mean=sum(turns) / n, tool_calls_mean=sum(calls) / n,
                     tool_errors=sum(e["errors"] for e in episodes), truncated=sum(e["truncated"] for e in episodes))
