"""`asyncgrpo train --help` gives every key's whole doc and the TRL name it answers to, and so does
docs/configuration.md: no help text is cut at an abbreviation, and no TRL key that is read goes unlisted."""

from pathlib import Path

import pytest

from asyncgrpo.cli import main
from asyncgrpo.config import reference, reference_markdown

REPO = Path(__file__).resolve().parents[2]


def _train_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    return capsys.readouterr().out


def _key_help(out: str, name: str) -> str:
    """The text printed under `--name`, as one line."""
    block = out.split(f"\n  --{name} ", 1)[1].split("\n  --", 1)[0]
    return " ".join(block.split("\n", 1)[1].split())


@pytest.mark.parametrize("name", ["dataset_config", "chat_template_kwargs", "reward_kwargs", "adapter_receiver_url",
                                  "deepspeed", "scale_rewards"])
def test_help_is_not_cut_at_an_abbreviation(capsys, name):
    doc = dict((n, d) for n, _, _, d in reference())[name]
    assert ("e.g." in doc or "Dr." in doc) and doc in _key_help(_train_help(capsys), name)


def test_every_key_gets_its_whole_doc_and_its_trl_name_in_help(capsys):
    out = _train_help(capsys)
    for name, _, _, doc in reference():
        text = _key_help(out, name)
        assert text.startswith(doc) and "TRL: " in text, name
    assert "TRL: `use_peft`" in _key_help(out, "use_lora")


@pytest.mark.parametrize("trl_key,ours", [("bf16", "torch_dtype"), ("save_strategy", "save_steps"),
                                          ("vllm_server_host", "vllm_server_base_url"),
                                          ("max_tool_calling_iterations", "max_turns")])
def test_trl_keys_read_under_another_name_are_in_help_and_in_the_key_reference(capsys, trl_key, ours):
    assert f"`{trl_key}" in _key_help(_train_help(capsys), ours)
    row = next(line for line in reference_markdown().splitlines() if line.startswith(f"| `{ours}` |"))
    assert f"`{trl_key}" in row
    assert reference_markdown() in (REPO / "docs" / "configuration.md").read_text()
