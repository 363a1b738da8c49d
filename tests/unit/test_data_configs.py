"""Every shipped config loads and validates without downloading anything; recipes say how to launch them."""

import re
from pathlib import Path

import pytest
import yaml

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rewards import RewardScorer

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
RECIPES = [p for p in CONFIGS if p.name != "demo.yaml"]


def header(path: Path) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, l in enumerate(lines) if not l.startswith("#"))])


def test_recipes_exist_for_the_models_the_project_names():
    models = {AsyncGRPOConfig.load(p).model_name_or_path for p in RECIPES}
    assert {"Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct"} <= models
    assert any(m.startswith("google/gemma") for m in models)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_its_reward_functions_import(path):
    cfg = AsyncGRPOConfig.load(path)  # unknown keys, bad types and bad combinations raise here
    scorer = RewardScorer(cfg.reward_funcs, cfg.reward_weights, cfg.reward_fallback, cfg.reward_kwargs)
    assert len(scorer.functions) == len(cfg.reward_funcs)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipes_open_with_the_commands_to_serve_and_to_train_with_fsdp2_and_zero3(path):
    cfg = AsyncGRPOConfig.load(path)
    text = header(path)
    serve = re.search(r"MODEL=(\S+) .*MAX_LORA_RANK=(\d+) MAX_LORAS=(\d+) MAX_MODEL_LEN=(\d+) launch/vllm/serve.sh",
                      text)
    assert serve, "the header must give the inference node's launch/vllm/serve.sh command"
    model, rank, loras, model_len = serve.group(1), *map(int, serve.groups()[1:])
    assert model == cfg.model_name_or_path and cfg.lora_r <= rank and loras >= cfg.max_staleness + 2
    assert model_len > cfg.max_completion_length
    assert (REPO / "launch/vllm/serve.sh").is_file()
    for backend in ("fsdp2", "zero3"):
        launch = (f"accelerate launch --config_file launch/accelerate/{backend}.yaml -m asyncgrpo train \\\n"
                  f"#                  --config configs/{path.name}")
        assert launch in text


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_knob_in_a_recipe_has_a_comment(path):
    keys = yaml.safe_load(path.read_text())
    lines = path.read_text().splitlines()
    for key in keys:
        line = next(l for l in lines if l.startswith(f"{key}:"))
        assert "#" in line, f"{path.name}: `{key}` has no comment"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipes_rewards_score_the_format_its_system_prompt_asks_for(path):
    cfg = AsyncGRPOConfig.load(path)
    scorer = RewardScorer(cfg.reward_funcs, cfg.reward_weights, cfg.reward_fallback, cfg.reward_kwargs)
    reference = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    good = [{"role": "assistant", "content": "48 + 24 = 72, so the answer is \\boxed{72}."}]
    wrong = [{"role": "assistant", "content": "The answer is 70."}]
    total, parts = scorer.score(["q"] * 2, [good, wrong], {"question": ["q"] * 2, "answer": [reference] * 2},
                                completion_ids=[[0] * 20, [0] * 10])
    assert parts["math_accuracy"] == [1.0, 0.0] and parts["format_reward"] == [1.0, 0.0]
    assert total[0] > total[1]
