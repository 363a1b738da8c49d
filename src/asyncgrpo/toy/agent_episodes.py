"""Episodes of the toy agent world in plain PyTorch: the warm-up's supervised episodes and `heldout_success`.

`warmup_batch` draws episodes over fresh random keys (so the model learns the format and to copy keys, not the
world's table) with deliberate mistakes, and renders them with the chat template, loss on assistant tokens only.
`heldout_success` plays episodes with HF `generate` and `LookupEnv`, continuing each turn on the sampled ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.toy.agent_chat import render_ids, tool_suffix_ids
from asyncgrpo.toy.agent_task import HOP_WEIGHTS, KEYS, LookupEnv, final_answer, question_text

MAX_LOOKUPS = len(HOP_WEIGHTS)
"""Warm-up episodes make at most this many calls, so 5 turns (4 calls + the answer) always suffice."""

CONTEXT = 256
"""The toy model's positions: an episode stops (truncated) when its next turn could not fit."""


def _call(key: str) -> dict[str, Any]:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}]}


def _random_entry(rng: random.Random, chance_of_key: float = 0.5) -> str:
    return rng.choice(KEYS) if rng.random() < chance_of_key else f"{rng.randrange(100):02d}"


def warmup_episode(rng: random.Random, stop_early_prob: float, wrong_key_prob: float) -> list[dict[str, Any]]:
    """One supervised episode: a fresh chain of 1-4 hops followed call by call. Before each call the episode
    answers a random number with `stop_early_prob`; a call swaps the key's letters with `wrong_key_prob`, and
    then the episode follows whatever that wrong key returns (a random key or value) to a wrong answer."""
    hops = rng.choices(range(1, MAX_LOOKUPS + 1), weights=HOP_WEIGHTS)[0]
    chain = [*rng.sample(KEYS, hops), f"{rng.randrange(100):02d}"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question_text(chain[0])}]
    current, position = chain[0], 0  # position: index of `current` in the chain, None once off the chain
    for calls in range(1, MAX_LOOKUPS + 1):
        if rng.random() < stop_early_prob:
            break
        key = current[::-1] if rng.random() < wrong_key_prob and current[0] != current[1] else current
        if key != current:
            position = None
        messages.append(_call(key))
        if position is not None:
            result = chain[position + 1]
            position += 1
        else:
            result = _random_entry(rng, chance_of_key=0.0 if calls == MAX_LOOKUPS else 0.5)
        messages.append({"role": "tool", "name": "lookup", "content": result})
        if result.isdigit():
            messages.append({"role": "assistant", "content": result})
            return messages
        current = result
    messages.append({"role": "assistant", "content": f"{rng.randrange(100):02d}"})  # a guess
    return messages


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
                 wrong_key_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` rendered warm-up episodes, right-padded: (inputs, labels), both (B, L); labels are -100 outside
    assistant turns and on padding."""
    tools = [LookupEnv().lookup]
    sequences = [render_ids(tokenizer, warmup_episode(rng, stop_early_prob, wrong_key_prob), tools)
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
    """Tool calls that raised (an unknown key, a call of a tool that does not exist)."""
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


def _run_tools(episode: _Episode, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages for `calls`; a tool that raises (or does not exist) answers `error: <message>`."""
    messages = []
    for call in calls:
        function = call.get("function", call)
        try:
            if function.get("name") != "lookup":
                raise LookupError(f"no tool named {function.get('name')}")
            content = str(episode.env.lookup(**(function.get("arguments") or {})))
        except (LookupError, TypeError) as exc:
            content, episode.errors = f"error: {exc}", episode.errors + 1
        messages.append({"role": "tool", "name": function.get("name"), "content": content})
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
