"""The toy tokenizer: one id per byte at 3 + b, ChatML specials at 0..2, and a decoder that never crashes."""

import pytest

from asyncgrpo.toy.tokenizer import (
    INVALID_ID_TEXT,
    SPECIAL_TOKENS,
    build_tokenizer,
    decode_completion,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_each_character_is_one_token_at_three_plus_its_byte(tokenizer):
    ids = tokenizer("07+45=", add_special_tokens=False)["input_ids"]
    assert ids == [51, 58, 46, 55, 56, 64]
    assert ids == [3 + ord(c) for c in "07+45="]
    assert tokenizer.decode(ids) == "07+45="


def test_spaces_and_newlines_are_single_tokens_too(tokenizer):
    ids = tokenizer("1 2\n", add_special_tokens=False)["input_ids"]
    assert ids == [52, 35, 53, 13]
    assert tokenizer.decode(ids) == "1 2\n"


def test_special_tokens_have_ids_zero_to_two_and_eos_is_pad(tokenizer):
    assert SPECIAL_TOKENS == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == 0
    assert tokenizer.pad_token_id == 0
    assert tokenizer.bos_token_id is None
    assert len(tokenizer) == 259


def test_special_token_text_encodes_to_its_single_id(tokenizer):
    ids = tokenizer("<|im_start|>user\n<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids == [1, 3 + ord("u"), 3 + ord("s"), 3 + ord("e"), 3 + ord("r"), 13, 2]


def test_no_bos_is_added_by_default(tokenizer):
    assert tokenizer("12")["input_ids"] == [52, 53]


def test_chat_template_is_chatml_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "07+45="}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nadd<|im_end|>\n"
        "<|im_start|>user\n07+45=<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_template_without_generation_prompt_ends_after_last_message(tokenizer):
    messages = [{"role": "user", "content": "07+45="}, {"role": "assistant", "content": "52"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == "<|im_start|>user\n07+45=<|im_end|>\n<|im_start|>assistant\n52<|im_end|>\n"


def test_saved_tokenizer_loads_back_with_same_ids_and_template(tokenizer, tmp_path):
    from transformers import AutoTokenizer  # heavy: transformers, only for the save-and-load test

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("07+45=", add_special_tokens=False)["input_ids"] == [51, 58, 46, 55, 56, 64]
    assert loaded.eos_token_id == 0
    assert loaded.chat_template == tokenizer.chat_template


def test_decode_completion_stops_at_first_eos(tokenizer):
    assert decode_completion(tokenizer, [56, 53, 0, 55, 0]) == "52"
    assert decode_completion(tokenizer, [0, 56, 53]) == ""


def test_decode_completion_replaces_padded_vocab_ids_instead_of_dropping_them(tokenizer):
    # "5", <pad id 300>, "2": dropping the pad id would turn a wrong sample into the right answer "52".
    assert decode_completion(tokenizer, [56, 300, 53]) == "5" + INVALID_ID_TEXT + "2"
    assert decode_completion(tokenizer, [259, 319, 0]) == INVALID_ID_TEXT * 2
    assert decode_completion(tokenizer, [-1]) == INVALID_ID_TEXT


def test_decode_completion_accepts_any_integer_iterable(tokenizer):
    torch = pytest.importorskip("torch")
    assert decode_completion(tokenizer, torch.tensor([56, 53, 0, 300])) == "52"
    assert decode_completion(tokenizer, []) == ""


def test_decode_completion_keeps_chat_specials_as_text(tokenizer):
    assert decode_completion(tokenizer, [56, 53, 2]) == "52<|im_end|>"
