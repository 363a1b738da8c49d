"""The toy agent world's chat format: tools in the system turn, tool calls that parse back to the same call,
the prefix property a multi-turn episode relies on, and the warm-up's assistant-only labels."""

import random

import pytest

from asyncgrpo.toy.agent_chat import RESPONSE_TEMPLATE, build_agent_tokenizer, render_ids, tool_suffix_ids
from asyncgrpo.toy.agent_episodes import assistant_labels, warmup_episode
from asyncgrpo.toy.agent_task import LookupEnv, is_value


@pytest.fixture(scope="module")
def tokenizer():
    return build_agent_tokenizer()


TOOLS = [LookupEnv().lookup]
USER = {"role": "user", "content": "find qx"}
CALL = {"role": "assistant", "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}
RESULT = {"role": "tool", "name": "lookup", "content": "-> mz"}


def test_template_declares_tools_and_renders_calls_and_tool_turns(tokenizer):
    text = tokenizer.apply_chat_template([USER, CALL, RESULT], tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nlookup()<|im_end|><|im_start|>user\nfind qx<|im_end|>"
                    "<|im_start|>assistant\n@lookup()<|im_end|><|im_start|>tool\n-> mz<|im_end|>"
                    "<|im_start|>assistant\n")
    assert not tokenizer.apply_chat_template([USER], tokenize=False).startswith("<|im_start|>system")  # no tools


def test_a_rendered_tool_call_parses_back_into_the_same_call_from_text_and_from_ids(tokenizer):
    prompt_ids = render_ids(tokenizer, [USER], TOOLS, add_generation_prompt=True)
    turn_ids = render_ids(tokenizer, [USER, CALL], TOOLS)[len(prompt_ids):]
    assert turn_ids[-1] == tokenizer.eos_token_id  # the model's stop token closes its turn: nothing to trim
    prefix = tokenizer.decode(prompt_ids)
    expected = {"role": "assistant", "tool_calls": CALL["tool_calls"]}
    assert tokenizer.parse_response(turn_ids, prefix=prefix, tools=TOOLS) == expected
    assert tokenizer.parse_response(tokenizer.decode(turn_ids), prefix=prefix) == expected
    assert tokenizer.parse_response("7<|im_end|>", prefix=prefix) == {"role": "assistant", "content": "7"}
    two = tokenizer.parse_response("@lookup(key=ab)@lookup(key=cd)<|im_end|>", prefix=prefix)
    assert [c["function"]["arguments"]["key"] for c in two["tool_calls"]] == ["ab", "cd"]


def test_tokenizer_saves_and_reloads_with_both_templates(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.response_template == RESPONSE_TEMPLATE and loaded.chat_template == tokenizer.chat_template
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_template_is_prefix_preserving_across_tool_turns(tokenizer):
    history = [USER, CALL]
    before = render_ids(tokenizer, history, TOOLS)
    after = render_ids(tokenizer, [*history, RESULT], TOOLS, add_generation_prompt=True)
    assert after[: len(before)] == before
    suffix = tool_suffix_ids(tokenizer, [RESULT], TOOLS)
    assert before + suffix == after
    assert tokenizer.decode(suffix) == "<|im_start|>tool\n-> mz<|im_end|><|im_start|>assistant\n"


def test_suffix_helper_rejects_a_template_that_rewrites_history(tokenizer):
    import copy

    rewriting = copy.copy(tokenizer)
    rewriting.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
                               "{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}")  # drops earlier turns
    with pytest.raises(ValueError, match="differently once tool messages"):
        tool_suffix_ids(rewriting, [RESULT], TOOLS)


def test_warmup_labels_cover_exactly_the_assistant_turns(tokenizer):
    episode = warmup_episode(random.Random(5), stop_early_prob=0.0, guess_prob=0.0)
    ids = render_ids(tokenizer, episode, TOOLS)
    labelled = tokenizer.decode([i for i in assistant_labels(tokenizer, ids) if i != -100])
    turns = [render_ids(tokenizer, episode[: i + 1], TOOLS)[len(render_ids(tokenizer, episode[:i], TOOLS, True)):]
             for i, m in enumerate(episode) if m["role"] == "assistant"]
    assert labelled == "".join(tokenizer.decode(t) for t in turns)
    assert labelled.endswith(f"{episode[-1]['content']}<|im_end|>") and "find" not in labelled


def test_warmup_episodes_call_until_the_value_unless_they_make_a_mistake(tokenizer):
    rng = random.Random(0)
    clean = [warmup_episode(rng, 0.0, 0.0) for _ in range(200)]
    for episode in clean:  # a call per turn while the tool returns a key, then the value it returned as the answer
        results = [m["content"] for m in episode if m["role"] == "tool"]
        calls = [m for m in episode if m.get("tool_calls")]
        assert all(c == CALL for c in calls) and len(calls) == len(results) and 1 <= len(calls) <= 4
        assert all(r.startswith("-> ") for r in results[:-1]) and results[-1] == f"= {episode[-1]['content']}"
        assert is_value(episode[-1]["content"])
    sloppy = [warmup_episode(rng, 0.3, 0.2) for _ in range(1000)]
    no_call = sum(len(e) == 2 for e in sloppy)  # answered (a guess) without calling
    assert 0.2 * 1000 < no_call < 0.4 * 1000 and all(is_value(e[-1]["content"]) for e in sloppy if len(e) == 2)
    read_value = [e for e in sloppy if e[-2]["content"].startswith("= ")]
    guessed = sum(e[-2]["content"] != f"= {e[-1]['content']}" for e in read_value)
    assert 0.1 * len(read_value) < guessed < 0.3 * len(read_value)
    stopped_on_a_key = [e for e in sloppy if e[-2]["content"].startswith("-> ")]
    answered_the_key = sum(e[-2]["content"] == f"-> {e[-1]['content']}" for e in stopped_on_a_key)
    assert stopped_on_a_key and 0.3 * len(stopped_on_a_key) < answered_the_key < 0.7 * len(stopped_on_a_key)
    assert all(sum(m["role"] == "tool" for m in e) <= 4 for e in sloppy)
