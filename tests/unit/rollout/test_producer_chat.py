"""Chat prompts and token ids outside the tokenizer, through the producer to the reward functions. The tokenizer is a
small Python one (ids 0-9 the digits, 10 an end-of-turn special token; `parse_response` splits at it) so that every
string below is written out; tests/integration/test_own_data.py runs a real chat template and response template. The
stub HTTP server stands in for vLLM because a real one does not sample a chosen padded-vocab id on demand."""

from fakes import generation

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.scoring import decode_completion

EOT = 10  # the end-of-turn special token
OOV = 12  # a padded vocab row: the model can sample it, the tokenizer has no text for it


class ChatTokenizer:
    def __init__(self):
        self.parse_calls = []

    def __len__(self):
        return 11

    def decode(self, ids, skip_special_tokens=False):  # transformers' default keeps special tokens
        assert all(0 <= i < len(self) for i in ids), ids
        return "".join("" if i == EOT and skip_special_tokens else "<eot>" if i == EOT else str(i) for i in ids)

    def parse_response(self, text, template, prefix=""):
        self.parse_calls.append((text, template, prefix))
        if not text.endswith("<eot>"):
            raise ValueError("the turn is not closed")
        return {"role": "assistant", "content": text[: -len("<eot>")]}


def test_ids_outside_the_tokenizer_decode_to_the_replacement_character_between_the_decoded_runs():
    tok = ChatTokenizer()
    assert decode_completion(tok, [1, 2, OOV, 3, 11, 11, 4]) == "12\ufffd3\ufffd\ufffd4"
    assert decode_completion(tok, [len(tok)]) == "\ufffd"  # the first id past the end is outside too
    assert decode_completion(tok, []) == ""
    assert decode_completion(tok, [1, 2, 3, 9]) == "1239"


def test_special_tokens_are_dropped_by_default_and_kept_on_request_on_both_sides_of_an_unknown_id():
    tok = ChatTokenizer()
    assert decode_completion(tok, [EOT, 1, OOV, 2, EOT]) == "1\ufffd2"
    assert decode_completion(tok, [EOT, 1, OOV, 2, EOT], skip_special_tokens=False) == "<eot>1\ufffd2<eot>"


def chat_route(rollout_on_stub):
    @generation
    def route(body):
        # completion 0 closes its turn; completion 1 samples a padded vocab row and runs out of tokens
        return rollout_on_stub.answer(body, [[7, EOT], [3, OOV]], ["stop", "length"])
    return route


def chat_rows():
    return [PromptRow(prompt=[{"role": "user", "content": f"q{i}"}], prompt_ids=[i], columns={},
                      rendered=f"<user>q{i}<eot><assistant>") for i in range(4)]


def recording_reward(seen):
    def reward(prompts, completions, **columns):
        seen.append({"prompts": prompts, "completions": completions, "parsed": columns.get("parsed", "absent")})
        return [1.0 if c[0]["content"] == "7" else 0.0 for c in completions]
    return reward


def test_a_chat_prompt_reaches_the_rewards_in_conversational_form_with_its_parsed_messages(rollout_on_stub):
    seen, tok, template = [], ChatTokenizer(), {"content": "whatever the tokenizer's parser reads"}
    rollout = rollout_on_stub(chat_route(rollout_on_stub), rows=chat_rows(), tokenizer=tok, response_template=template,
                              reward=recording_reward(seen), groups_per_step=1)
    (group,) = rollout.run()
    (call,) = seen
    i = group.prompt_ids[0]  # row i has prompt ids [i]
    assert call["prompts"] == [[{"role": "user", "content": f"q{i}"}]] * 2  # the messages, once per completion
    assert call["completions"] == [[{"role": "assistant", "content": "7"}],
                                   [{"role": "assistant", "content": "3\ufffd"}]]
    # parsed from the text with its special tokens (the end of turn closes the region), after the rendered prompt
    rendered = f"<user>q{i}<eot><assistant>"
    assert tok.parse_calls == [("7<eot>", template, rendered), ("3\ufffd", template, rendered)]
    assert call["parsed"] == [{"role": "assistant", "content": "7"}, None]  # the unclosed turn does not parse
    assert group.prompt == rendered  # what was sent, for logs and the trainer
    assert group.rewards == [1.0, 0.0]


def test_a_chat_prompt_without_a_response_template_gets_no_parsed_messages(rollout_on_stub):
    seen, tok = [], ChatTokenizer()
    rollout = rollout_on_stub(chat_route(rollout_on_stub), rows=chat_rows(), tokenizer=tok,
                              reward=recording_reward(seen), groups_per_step=1)
    (group,) = rollout.run()
    assert seen[0]["parsed"] == "absent" and tok.parse_calls == []
    assert seen[0]["completions"][0] == [{"role": "assistant", "content": "7"}]
    assert group.rewards == [1.0, 0.0]
