"""Held-out prompts: `eval_dataset` when set, else the `dataset_test_split` split of `dataset_name` (TRL's script
argument), on local sources written here; a split the source lacks is an error naming the ones it has."""

import json
from types import SimpleNamespace

import datasets
import pytest
from fakes import cfg

from asyncgrpo import data
from asyncgrpo.errors import ConfigError
from asyncgrpo.toy.tokenizer import build_tokenizer

TRAIN = [{"prompt": "12,34>", "answer": "34"}, {"prompt": "56,07>", "answer": "56"}]
TEST = [{"prompt": "88,99>", "answer": "99"}]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompts(rows) -> list[str]:
    return [r.prompt for r in rows]


def evaluated(tokenizer, **values) -> list[str]:
    return _prompts(data.load_eval_prompts(cfg(eval_strategy="steps", **values), tokenizer))


def test_a_saved_dataset_dict_is_evaluated_on_its_test_split_and_trained_on_its_train_split(tmp_path, tokenizer):
    datasets.DatasetDict(train=datasets.Dataset.from_list(TRAIN), test=datasets.Dataset.from_list(TEST)) \
        .save_to_disk(str(tmp_path / "saved"))
    c = cfg(dataset_name=str(tmp_path / "saved"), eval_strategy="steps")
    assert evaluated(tokenizer, dataset_name=str(tmp_path / "saved")) == ["88,99>"]
    assert [r["prompt"] for r in data.read_records(c)[0]] == ["12,34>", "56,07>"]
    assert evaluated(tokenizer, dataset_name=str(tmp_path / "saved"), dataset_test_split="train") == \
        ["12,34>", "56,07>"]


def test_a_directory_of_split_files_is_read_as_a_hub_dataset_is(tmp_path, tokenizer):
    # `datasets` names a repository's splits after its files (train.jsonl, validation.jsonl), hub or local alike.
    (tmp_path / "repo").mkdir()
    _jsonl(tmp_path / "repo" / "train.jsonl", TRAIN)
    _jsonl(tmp_path / "repo" / "validation.jsonl", TEST)
    assert evaluated(tokenizer, dataset_name=str(tmp_path / "repo"), dataset_test_split="validation") == ["88,99>"]
    with pytest.raises(ConfigError) as info:
        evaluated(tokenizer, dataset_name=str(tmp_path / "repo"))  # TRL's default split, `test`, is not there
    assert info.value.field == "dataset_test_split"
    assert "'test' is not a split of" in str(info.value) and "['train', 'validation']" in str(info.value)
    assert "set dataset_test_split to one of those, or name held-out prompts with eval_dataset" in str(info.value)


def test_a_single_file_has_only_a_train_split_and_the_error_says_so(tmp_path, tokenizer):
    path = _jsonl(tmp_path / "prompts.jsonl", TRAIN)
    with pytest.raises(ConfigError) as info:
        evaluated(tokenizer, dataset_name=str(path))
    assert info.value.field == "dataset_test_split" and "its splits: ['train']" in str(info.value)


def test_a_saved_dataset_dict_without_the_split_names_its_splits(tmp_path, tokenizer):
    datasets.DatasetDict(train=datasets.Dataset.from_list(TRAIN), dev=datasets.Dataset.from_list(TEST)) \
        .save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ConfigError) as info:
        evaluated(tokenizer, dataset_name=str(tmp_path / "saved"))
    assert info.value.field == "dataset_test_split" and "its splits: ['train', 'dev']" in str(info.value)
    datasets.Dataset.from_list(TRAIN).save_to_disk(str(tmp_path / "one"))  # one Dataset: no splits at all
    with pytest.raises(ConfigError, match="holds one `Dataset` \\(no splits\\)"):
        evaluated(tokenizer, dataset_name=str(tmp_path / "one"))


def test_eval_dataset_wins_over_the_test_split_and_no_evaluation_reads_nothing(tmp_path, tokenizer):
    datasets.DatasetDict(train=datasets.Dataset.from_list(TRAIN), test=datasets.Dataset.from_list(TEST)) \
        .save_to_disk(str(tmp_path / "saved"))
    held_out = _jsonl(tmp_path / "held_out.jsonl", [{"prompt": "01,02>", "answer": "02"}])
    assert evaluated(tokenizer, dataset_name=str(tmp_path / "saved"), eval_dataset=str(held_out)) == ["01,02>"]
    assert data.load_eval_prompts(cfg(dataset_name=str(tmp_path / "saved")), tokenizer) == []  # eval_strategy: no


def test_the_toy_dataset_s_test_split_is_its_held_out_prompts(tmp_path, tokenizer, monkeypatch):
    world = SimpleNamespace(train_file=_jsonl(tmp_path / "train.jsonl", TRAIN),
                            heldout_file=_jsonl(tmp_path / "heldout.jsonl", TEST))
    monkeypatch.setattr(data, "toy_world", lambda c: world)  # the files of a built toy world, without building one
    assert evaluated(tokenizer) == ["88,99>"]
    with pytest.raises(ConfigError) as info:
        evaluated(tokenizer, dataset_test_split="validation")
    assert info.value.field == "dataset_test_split" and "the toy dataset; its splits: ['train', 'test']" in \
        str(info.value)


def test_an_environment_run_without_a_dataset_must_name_its_held_out_prompts():
    with pytest.raises(ConfigError) as info:
        cfg(eval_strategy="steps", dataset_name="environment", environment_factory="agent_tools:Counter")
    assert info.value.field == "eval_dataset" and "no dataset to take dataset_test_split from" in str(info.value)
