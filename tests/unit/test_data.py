"""Prompt datasets on local files written here: formats, columns, chat templates, over-long prompts, the order."""

import json
import os
import random

import pytest
from fakes import cfg

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data import (PromptFormat, PromptStream, build_rows, load_prompt_set, parse_completions,
                            prompt_length_limit, response_template_for, server_max_model_len)
from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.tokenizer import BYTE_OFFSET, build_tokenizer

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
               "$<<0.2*50=10>>10.\n#### 10"},
    {"question": "What is 1000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"},
]

# A ChatML-like template that, like Qwen3's, pre-writes `<think>` into the assistant turn when asked to think.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}"
)
# A response template (transformers' declarative format) for that chat template: thinking, tool calls, content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "thinking": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    """The toy byte-level tokenizer: one token per character, a ChatML chat template."""
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A tokenizer built here with its own chat template and response template, saved and loaded back like a
    model's tokenizer would be."""
    from transformers import AutoTokenizer  # heavy: transformers, only for the tokenizer tests

    tok = build_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    path = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ids_of(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode()]


# ---- sources and columns ------------------------------------------------------------------------------------------
def test_gsm8k_jsonl_prompts_are_tokenised_once_and_other_columns_reach_rewards(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    prompts = load_prompt_set(cfg(dataset_name=str(path), prompt_column="question"), tokenizer)
    assert prompts.total == 3 and len(prompts.rows) == 3 and prompts.skipped_too_long == 0
    row = prompts.rows[0]
    assert row.prompt == GSM8K_ROWS[0]["question"] and not row.is_chat
    assert row.prompt_ids == ids_of(GSM8K_ROWS[0]["question"])
    assert row.columns == {"answer": GSM8K_ROWS[0]["answer"]}
    assert prompts.response_template is None  # text prompts are never parsed


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet", "csv", "arrow", "save_to_disk", "save_to_disk_dict"])
def test_every_local_format_loads_through_datasets(tmp_path, tokenizer, fmt):
    import datasets  # heavy: datasets, only for the file-format tests

    ds = datasets.Dataset.from_list(GSM8K_ROWS)
    if fmt.startswith("save_to_disk"):
        (datasets.DatasetDict({"train": ds}) if fmt.endswith("dict") else ds).save_to_disk(str(tmp_path / "ds"))
        config = cfg(dataset_name=str(tmp_path / "ds"), prompt_column="question")
    elif fmt == "arrow":
        ds.save_to_disk(str(tmp_path / "ds"))
        arrow = next((tmp_path / "ds").glob("*.arrow"))
        config = cfg(dataset_name="arrow", data_files=[str(arrow)], prompt_column="question")
    else:
        path = tmp_path / f"data.{fmt}"
        {"json": ds.to_json, "jsonl": ds.to_json, "parquet": ds.to_parquet,
         "csv": lambda p: ds.to_csv(p, index=False)}[fmt](str(path))
        config = cfg(dataset_name=str(path), prompt_column="question")
    prompts = load_prompt_set(config, tokenizer)
    assert [r.prompt for r in prompts.rows] == [r["question"] for r in GSM8K_ROWS]
    assert [r.columns["answer"] for r in prompts.rows] == [r["answer"] for r in GSM8K_ROWS]


def test_data_files_with_a_format_name(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", GSM8K_ROWS[:2])
    b = write_jsonl(tmp_path / "b.jsonl", GSM8K_ROWS[2:])
    prompts = load_prompt_set(cfg(dataset_name="json", data_files=[str(a), str(b)], prompt_column="question"),
                              tokenizer)
    assert len(prompts.rows) == 3


def test_a_missing_column_lists_the_columns_present(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(path)), tokenizer)  # prompt_column defaults to `prompt`
    assert err.value.field == "prompt_column"
    assert "'prompt' is not a column of" in str(err.value) and "['answer', 'question']" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(path), messages_column="messages"), tokenizer)
    assert err.value.field == "messages_column" and "['answer', 'question']" in str(err.value)


def test_a_column_named_like_a_reward_argument_is_an_error(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "completions": "x"}])
    with pytest.raises(ConfigError, match=r"column\(s\) \['completions'\]"):
        load_prompt_set(cfg(dataset_name=str(path)), tokenizer)


def test_missing_files_and_unknown_splits_are_config_errors(tmp_path, tokenizer):
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name="json", data_files=[str(tmp_path / "nope.jsonl")]), tokenizer)
    assert err.value.field == "data_files"
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(path), prompt_column="question", dataset_train_split="test"),
                        tokenizer)
    assert err.value.field == "dataset_train_split" and "train" in str(err.value)
    (tmp_path / "data.txt").write_text("hello\n")
    with pytest.raises(ConfigError, match="a .txt file"):
        load_prompt_set(cfg(dataset_name=str(tmp_path / "data.txt")), tokenizer)


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") != "1", reason="needs HF_HUB_OFFLINE=1 (never reach the hub)")
def test_an_unreachable_hub_dataset_is_a_config_error(tokenizer):
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name="openai/gsm8k", dataset_config="main"), tokenizer)
    assert err.value.field == "dataset_name" and "openai/gsm8k" in str(err.value)


# ---- prompt length ------------------------------------------------------------------------------------------------
def test_over_long_prompts_are_skipped_and_counted_not_truncated(tmp_path, tokenizer):
    rows = [{"prompt": "x" * n, "answer": str(n)} for n in (10, 50, 51, 200)]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    prompts = load_prompt_set(cfg(dataset_name=str(path), max_prompt_length=50), tokenizer)
    assert [len(r.prompt_ids) for r in prompts.rows] == [10, 50]
    assert prompts.skipped_too_long == 2 and prompts.total == 4
    # From the server: max_model_len 64 - max_completion_length 14 = 50 tokens of prompt.
    prompts = load_prompt_set(cfg(dataset_name=str(path), max_completion_length=14), tokenizer,
                              server_max_model_len=64)
    assert prompts.max_prompt_length == 50 and prompts.skipped_too_long == 2
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(path), max_prompt_length=5), tokenizer)
    assert err.value.field == "max_prompt_length" and "all 4 prompts" in str(err.value)


def test_the_smaller_of_max_prompt_length_and_the_servers_room_wins():
    assert prompt_length_limit(cfg(max_completion_length=16), None) is None
    assert prompt_length_limit(cfg(max_completion_length=16), 256) == 240
    assert prompt_length_limit(cfg(max_completion_length=16, max_prompt_length=100), 256) == 100
    assert prompt_length_limit(cfg(max_completion_length=16, max_prompt_length=1000), 256) == 240
    with pytest.raises(ConfigError) as err:
        prompt_length_limit(cfg(max_completion_length=256), 256)
    assert err.value.field == "max_completion_length" and "--max-model-len" in str(err.value)


def test_the_servers_max_model_len_is_read_from_the_base_model_entry():
    models = [{"id": "policy-v1", "parent": "base", "root": "/a/v1", "max_model_len": 256},
              {"id": "base", "parent": None, "root": "base", "max_model_len": 512}]
    assert server_max_model_len(models) == 512
    assert server_max_model_len([{"id": "base", "parent": None}]) is None


# ---- chat templates -----------------------------------------------------------------------------------------------
def test_chat_messages_go_through_the_tokenizers_own_chat_template(tmp_path, chat_tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "#### 4"}])
    config = cfg(dataset_name=str(path), messages_column="messages", system_prompt="Box the answer.",
                   chat_template_kwargs={"enable_thinking": True})
    prompts = load_prompt_set(config, chat_tokenizer)
    row = prompts.rows[0]
    expected = ("<|im_start|>system\nBox the answer.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n")
    assert row.is_chat and row.rendered == expected
    assert row.prompt_ids == chat_tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert row.prompt == messages  # reward functions get the messages, as in TRL
    assert row.columns == {"answer": "#### 4"}
    assert prompts.response_template == RESPONSE_TEMPLATE  # the tokenizer's own


def test_text_prompts_become_user_messages_in_chat_mode(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    config = cfg(dataset_name=str(path), prompt_column="question", prompt_format="chat",
                   chat_template_kwargs={"enable_thinking": False})
    row = load_prompt_set(config, chat_tokenizer).rows[2]
    assert row.rendered == "<|im_start|>user\nWhat is 1000 + 234?<|im_end|>\n<|im_start|>assistant\n"
    assert row.prompt == [{"role": "user", "content": "What is 1000 + 234?"}]


def test_trl_conversational_prompts_in_the_prompt_column_are_chat(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    row = load_prompt_set(cfg(dataset_name=str(path)), chat_tokenizer).rows[0]
    assert row.rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_format_mismatches_are_errors_that_name_the_fix(tmp_path, chat_tokenizer):
    chat = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(chat), prompt_format="raw"), chat_tokenizer)
    assert err.value.field == "prompt_format" and "chat template" in str(err.value)
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(text), system_prompt="Be brief."), chat_tokenizer)
    assert err.value.field == "system_prompt" and "prompt_format: chat" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_prompt_set(cfg(dataset_name=str(text), messages_column="prompt"), chat_tokenizer)
    assert err.value.field == "messages_column"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "hi"}]}])
    with pytest.raises(ConfigError, match="row 0 of"):
        load_prompt_set(cfg(dataset_name=str(bad)), chat_tokenizer)


def test_a_tokenizer_without_chat_template_is_an_error_for_chat_prompts(tokenizer):
    from transformers import PreTrainedTokenizerFast  # heavy: transformers, only for this test

    plain = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    assert plain.chat_template is None
    with pytest.raises(ConfigError, match="has no chat template"):
        build_rows([{"prompt": "hi"}], plain, PromptFormat(prompt_format="chat"), source="rows")


# ---- parsed responses ---------------------------------------------------------------------------------------------
def test_completions_are_parsed_with_transformers_parse_response_and_the_prompt_as_prefix(chat_tokenizer):
    def prefix(thinking: bool) -> str:
        return chat_tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=thinking)

    # `<think>` was written by the chat template, not by the model: only the prefix tells the parser.
    thought = parse_completions(chat_tokenizer, RESPONSE_TEMPLATE, prefix(True),
                                ["2 plus 2 is 4</think>The answer is \\boxed{4}<|im_end|>"])
    assert thought == [{"role": "assistant", "thinking": "2 plus 2 is 4", "content": "The answer is \\boxed{4}"}]
    texts = ['Calling.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call><|im_end|>',
             "<tool_call>{not json</tool_call><|im_end|>"]
    calls, broken = parse_completions(chat_tokenizer, RESPONSE_TEMPLATE, prefix(False), texts)
    assert calls == {"role": "assistant", "content": "Calling.",
                     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]}
    assert broken is None  # what the parser rejects is handed on as None, never a crash


def test_the_response_template_is_the_tokenizers_else_transformers_own_for_the_model_type(tokenizer, chat_tokenizer):
    assert response_template_for(chat_tokenizer, "qwen2") == RESPONSE_TEMPLATE  # the tokenizer's own wins
    qwen = response_template_for(tokenizer, "qwen2")  # the toy tokenizer has none; transformers ships Qwen2's
    assert qwen is not None and qwen["start_anchor"] == "<|im_start|>assistant\n"
    assert response_template_for(tokenizer, "gemma4") is not None
    assert response_template_for(tokenizer, "no_such_model_type") is None
    assert response_template_for(tokenizer, None) is None


def test_parse_responses_false_turns_parsing_off(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "conv.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    prompts = load_prompt_set(cfg(dataset_name=str(path), parse_responses=False), chat_tokenizer)
    assert prompts.response_template is None


# ---- the order ----------------------------------------------------------------------------------------------------
def test_prompt_order_is_deterministic_per_epoch_and_resumes_at_the_exact_position():
    rows = list(range(7))
    stream = PromptStream(rows, seed=3)
    first = [next(stream) for _ in range(7 * 3)]
    for epoch in range(3):
        block = first[epoch * 7:(epoch + 1) * 7]
        assert sorted(block) == rows  # every epoch is one whole permutation: epoch boundaries are exact
        order = list(range(7))
        random.Random(3 * 100_003 + epoch).shuffle(order)  # the order the producer has always used
        assert block == [rows[i] for i in order]
    assert first[:7] != first[7:14]  # epochs are reshuffled
    assert [next(PromptStream(rows, seed=3)) for _ in range(1)] == first[:1]
    resumed = PromptStream(rows, seed=3, start=10)  # mid-epoch 1
    assert [next(resumed) for _ in range(11)] == first[10:21] and resumed.position == 21 and resumed.epoch == 3
    assert [next(PromptStream(rows, seed=4)) for _ in range(7)] != first[:7]


def test_the_toy_split_loads_as_before(tokenizer):
    from asyncgrpo.data import load_prompts, toy_world

    config = cfg()
    prompts = load_prompt_set(config, tokenizer)
    before = load_prompts(toy_world(config).train_file, tokenizer, "prompt")
    assert [(r.prompt, r.prompt_ids, r.columns) for r in prompts.rows] == \
        [(r.prompt, r.prompt_ids, r.columns) for r in before]
    assert prompts.rows[0].prompt_ids == ids_of(prompts.rows[0].prompt) and not prompts.rows[0].is_chat


# ---- config keys --------------------------------------------------------------------------------------------------
def test_data_config_keys_are_checked_and_name_their_fix():
    cases = [({"prompt_format": "jinja"}, "prompt_format"),
             ({"prompt_format": "raw", "system_prompt": "x"}, "system_prompt"),
             ({"data_files": ["a.jsonl"]}, "dataset_name"),
             ({"max_prompt_length": 0}, "max_prompt_length"),
             ({"reward_kwargs": {"format_reward": {"pattern": "x"}}}, "reward_kwargs"),
             ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs")]
    for values, field in cases:
        with pytest.raises(ConfigError) as err:
            cfg(**values)
        assert err.value.field == field and "Fix:" in str(err.value)


def test_mappings_can_be_overridden_on_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model_name_or_path: toy\nlora_adapter_path: /tmp/a\n"
                    "reward_funcs: [asyncgrpo.rewards:format_reward]\n")
    config = AsyncGRPOConfig.load(path, ["--chat_template_kwargs", "{enable_thinking: false}",
                                      "--reward_kwargs", "{format_reward: {pattern: '<answer>'}}",
                                      "--data_files", "a.jsonl,b.jsonl", "--dataset_name", "json"])
    assert config.chat_template_kwargs == {"enable_thinking": False}
    assert config.reward_kwargs == {"format_reward": {"pattern": "<answer>"}}
    assert config.data_files == ["a.jsonl", "b.jsonl"]


def test_model_dir_is_a_local_directory_as_given_or_the_hub_cache_snapshot(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from asyncgrpo.data import local_model_dir

    assert local_model_dir(str(tmp_path)) == str(tmp_path)
    # What the local main process downloaded: the others (offline here) find it in the cache, no hub needed.
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert local_model_dir("acme/tiny") == str(snapshot)
    with pytest.raises(ConfigError) as err:
        local_model_dir("acme/absent")
    assert err.value.field == "model_name_or_path" and "acme/absent" in str(err.value)
