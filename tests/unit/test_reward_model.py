"""A reward model in `reward_funcs`: a tiny Qwen2ForSequenceClassification saved with the toy tokenizer, scored in
batches (padded) exactly as one completion at a time, by name in the scorer, and in a reward worker process."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.data import PromptRow
from asyncgrpo.errors import ConfigError
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.reward_pool import RewardPool, TokenizerRef
from asyncgrpo.rollout.scoring import InThreadScoring
from asyncgrpo.toy.architectures import COMMON
from asyncgrpo.toy.tokenizer import build_tokenizer

COMPLETIONS = ["45", "a longer completion, 7", "7"]  # different lengths: the batch is padded


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(**{**COMMON, "num_labels": 1}))
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def one_at_a_time(path, texts: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification

    tokenizer = build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                for t in texts]


def test_a_reward_model_scores_prompt_plus_completion_in_padded_batches_as_one_at_a_time(reward_model_dir):
    scorer = RewardScorer([str(reward_model_dir)], kwargs={"tiny-rm": {"batch_size": 2}})
    total, parts = scorer.score(["07,45>"] * 3, COMPLETIONS, {})
    expected = one_at_a_time(reward_model_dir, ["07,45>" + c for c in COMPLETIONS])
    assert total == pytest.approx(expected, abs=1e-5)
    assert len(set(round(x, 4) for x in expected)) == 3  # the scores differ: the comparison is not vacuous
    assert parts == {"tiny-rm": total}  # named by its directory


def test_a_chat_prompt_is_scored_through_the_reward_models_chat_template(reward_model_dir):
    scorer = RewardScorer([str(reward_model_dir)])
    prompt = [{"role": "user", "content": "07,45>"}]
    completion = [{"role": "assistant", "content": "45"}]
    total, _ = scorer.score([prompt], [completion], {})
    text = build_tokenizer().apply_chat_template(prompt + completion, tokenize=False)
    assert total == pytest.approx(one_at_a_time(reward_model_dir, [text]), abs=1e-5)


def test_a_reward_model_scores_in_a_reward_worker_as_in_the_thread(reward_model_dir):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(reward_model_dir.parent / "policy-tokenizer")
    tokenizer = type(tokenizer).from_pretrained(reward_model_dir.parent / "policy-tokenizer")
    row = PromptRow(prompt="07,45>", prompt_ids=tokenizer("07,45>")["input_ids"], columns={})
    ids = [tokenizer(c)["input_ids"] for c in COMPLETIONS]
    in_thread = InThreadScoring(RewardScorer([str(reward_model_dir)]), tokenizer).score_group(row, ids, ["stop"] * 3)
    pool = RewardPool(1, RewardScorer([str(reward_model_dir)]), TokenizerRef.of(tokenizer), timeout_s=120)
    try:
        pooled = pool.score_group(row, ids, ["stop"] * 3)
    finally:
        pool.close()
    assert pooled[0] == pytest.approx(in_thread[0], abs=1e-5)
    assert in_thread[0] == pytest.approx(one_at_a_time(reward_model_dir, ["07,45>" + c for c in COMPLETIONS]),
                                         abs=1e-5)


def test_an_entry_that_is_neither_a_function_nor_a_model_directory_names_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="neither `package.module:function` nor a model directory"):
        RewardScorer([str(tmp_path / "missing")])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="reward_kwargs.*it takes `batch_size` only"):
        RewardScorer([str(tmp_path)], kwargs={str(tmp_path): {"temperature": 1}})
