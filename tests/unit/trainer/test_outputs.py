"""What a TRL user finds beside an adapter: trainer_state.json in transformers' layout, and the model card."""

import dataclasses
import json

import pytest
from fakes import cfg
from transformers import TrainerState

from asyncgrpo.trainer.outputs import LogHistory, history_names, model_card


def test_tracker_names_become_transformers_log_history_names():
    assert history_names({"train/loss": 0.5, "train/rewards/f/mean": 1.0, "eval/reward": 0.8,
                          "eval/rewards/f/mean": 0.7, "staleness/max": 1.0}) == {
        "loss": 0.5, "rewards/f/mean": 1.0, "eval_reward": 0.8, "eval_rewards/f/mean": 0.7, "staleness/max": 1.0}


def test_trainer_state_json_has_every_field_of_transformers_trainer_state_and_reads_back(tmp_path):
    history = LogHistory()
    history.log({"train/loss": 0.25, "train/reward": 0.5}, 2)
    history.log({"eval/reward": 0.75}, 2)
    history.log({"train/loss": 0.125, "train/reward": 0.625}, 4)
    c = cfg(max_steps=6, logging_steps=2, save_steps=4, per_device_train_batch_size=16)
    path = tmp_path / "trainer_state.json"
    path.write_text(history.trainer_state_json(c, 4))
    assert set(json.loads(path.read_text())) == {f.name for f in dataclasses.fields(TrainerState)}
    state = TrainerState.load_from_json(str(path))
    assert (state.global_step, state.max_steps, state.logging_steps, state.save_steps, state.train_batch_size) == \
        (4, 6, 2, 4, 16)
    assert state.log_history == [{"loss": 0.25, "reward": 0.5, "step": 2}, {"eval_reward": 0.75, "step": 2},
                                 {"loss": 0.125, "reward": 0.625, "step": 4}]
    assert state.best_metric is None and state.best_model_checkpoint is None  # no best model is kept


def test_a_resumed_history_continues_the_checkpoint_s_and_finds_its_last_evaluation():
    saved = {"log_history": [{"loss": 0.5, "step": 1}, {"eval_reward": 0.4, "step": 2}, {"loss": 0.3, "step": 2}]}
    history = LogHistory.resumed(saved)
    assert history.last_evaluation() == {"eval_reward": 0.4, "step": 2}
    history.log({"eval/reward": 0.9}, 4)
    assert [e["step"] for e in history.entries] == [1, 2, 2, 4] and history.last_evaluation()["eval_reward"] == 0.9
    assert LogHistory.resumed(None).entries == []  # a checkpoint from before trainer_state.json
    assert LogHistory().last_evaluation() is None


def card(**values):
    c = cfg(**{"max_steps": 60, "lora_r": 16, "lora_alpha": 32, **values})
    return model_card(c, base_model="Qwen/Qwen2.5-0.5B-Instruct", adapter_dir="/runs/gsm8k/checkpoint-40", step=40,
                      version=40, evaluation={"eval_reward": 0.8125, "eval_rewards/math_accuracy/mean": 0.75,
                                              "step": 40})


def test_the_model_card_names_base_model_dataset_rewards_steps_evaluation_and_how_to_load():
    text = card(dataset_name="openai/gsm8k", dataset_config="main",
                reward_funcs=["asyncgrpo.rewards:math_accuracy", "asyncgrpo.rewards:think_format"],
                reward_weights=[1.0, 0.25])
    front, body = text.split("---\n")[1], text.split("---\n", 2)[2]
    assert front == 'base_model: "Qwen/Qwen2.5-0.5B-Instruct"\nlibrary_name: peft\n' \
                    "tags: [asyncgrpo, grpo, lora, reinforcement-learning]\n"
    assert "- **Dataset:** `openai/gsm8k` (config `main`), split `train`" in body
    assert "  - `math_accuracy` (weight 1)\n  - `think_format` (weight 0.25)" in body
    assert "- **Steps:** 40 optimizer steps of 60 (policy version 40)" in body
    assert "At step 40, on `openai/gsm8k` split `test`" in body
    assert "| `eval_reward` | 0.8125 |\n| `eval_rewards/math_accuracy/mean` | 0.7500 |" in body
    assert "base = AutoModelForCausalLM.from_pretrained('Qwen/Qwen2.5-0.5B-Instruct')\n" \
           "model = PeftModel.from_pretrained(base, '/runs/gsm8k/checkpoint-40')" in body
    assert "--max-lora-rank 16 --lora-modules policy=/runs/gsm8k/checkpoint-40" in body


@pytest.mark.parametrize("values,line", [
    ({"eval_strategy": "steps", "eval_dataset": "held_out.jsonl"}, "At step 40, on `held_out.jsonl`"),
    ({"environment_factory": "agent_tools:Counter", "dataset_name": "environment"},
     "- **Reward functions:**\n  - `agent_tools:Counter`'s get_reward()"),
])
def test_the_model_card_names_where_held_out_prompts_and_rewards_came_from(values, line):
    assert line in card(**values)


def test_a_card_without_an_evaluation_says_none_ran():
    c = cfg()
    text = model_card(c, base_model="/models/toy", adapter_dir="out", step=3, version=3, evaluation=None)
    assert "None ran (`eval_strategy: no`, or none before this step)." in text and "| metric |" not in text
