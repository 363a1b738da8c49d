"""The Python API without a run: objects become the config's values, what cannot reach another process is refused
naming the fix, TRL's arguments asyncgrpo has no counterpart for are refused, and callbacks get transformers' hooks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, parse_args
from asyncgrpo.errors import ConfigError
from asyncgrpo.objects import crossing_problems, reference, remembered
from asyncgrpo.rewards import load_reward_function, reward_name
from asyncgrpo.trainer.callbacks import Callbacks


def exact(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def args(tmp_path, **values):
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), **values)


def test_a_top_level_function_is_named_by_its_module_and_loaded_back_as_the_very_object():
    ref = reference(exact, "reward_funcs")
    assert ref == f"{__name__}:exact" and reward_name(ref) == "exact"
    assert load_reward_function(ref) is exact


def test_two_lambdas_get_distinct_references_and_each_loads_its_own_object():
    first, second = (lambda completions, **k: [1.0]), (lambda completions, **k: [2.0])
    a, b = reference(first, "reward_funcs"), reference(second, "reward_funcs")
    assert a != b and remembered(a) is first and remembered(b) is second
    assert load_reward_function(b)(completions=["x"]) == [2.0]


def test_objects_become_config_values_and_datasets_a_directory_in_output_dir(tmp_path):
    from datasets import Dataset
    from peft import LoraConfig

    trainer = AsyncGRPOTrainer(model="toy", reward_funcs=exact, args=args(tmp_path),
                               train_dataset=Dataset.from_list([{"prompt": "07,45>", "answer": "45"}]),
                               peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj"]))
    cfg = trainer.args
    assert cfg.reward_funcs == [f"{__name__}:exact"]  # replaced the toy reward `model: toy` had filled in
    assert cfg.dataset_name == str((tmp_path / "out" / "datasets" / "train").resolve())
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_target_modules) == (4, 8.0, ["q_proj", "v_proj"])


def test_an_argument_given_to_the_trainer_and_in_args_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="given twice"):
        AsyncGRPOTrainer(model="toy", reward_funcs=exact, args=args(tmp_path, reward_funcs=["m:other"]))


@pytest.mark.parametrize("kwargs,field,says", [
    ({"optimizers": (object(), None)}, "optimizers", "AdamW"),
    ({"rollout_func": print}, "rollout_func", "environment_factory"),
    ({"model": type("Model", (), {"config": None, "name_or_path": "org/m"})()}, "model", "'org/m'"),
])
def test_what_asyncgrpo_cannot_take_is_refused_with_what_to_do(tmp_path, kwargs, field, says):
    kwargs = {"model": "toy", **kwargs}
    with pytest.raises(ConfigError, match=says) as err:
        AsyncGRPOTrainer(args=args(tmp_path), **kwargs)
    assert err.value.field == field


def test_lora_fields_the_server_does_not_load_are_named(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ConfigError, match="sets use_rslora, use_dora,") as err:
        AsyncGRPOTrainer(model="toy", args=args(tmp_path),
                         peft_config=LoraConfig(r=4, target_modules=["q_proj"], use_dora=True, use_rslora=True))
    assert err.value.field == "peft_config"


def test_unset_target_modules_are_peft_defaults_for_the_model_type(tmp_path):
    from peft import LoraConfig

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cfg = AsyncGRPOTrainer(model=str(model), reward_funcs=exact, train_dataset="data.jsonl", args=args(tmp_path),
                           peft_config=LoraConfig(r=4)).args
    assert cfg.lora_target_modules == ["q_proj", "v_proj"]  # PEFT's mapping for llama


def test_a_dataset_dict_is_refused_naming_a_split(tmp_path):
    from datasets import Dataset, DatasetDict

    with pytest.raises(ConfigError, match=r"ds\['train'\]"):
        AsyncGRPOTrainer(model="toy", args=args(tmp_path),
                         train_dataset=DatasetDict({"train": Dataset.from_list([{"prompt": "a"}])}))


def test_which_process_can_import_what(tmp_path):
    closure = (lambda completions, **k: [0.0])
    try:
        main = reference(_rebound(exact), "reward_funcs")
        assert main == "__main__:exact_for_test"
        lam = reference(closure, "reward_funcs")
        in_rank0 = AsyncGRPOConfig(model_name_or_path="m", reward_funcs=[main, lam])
        assert crossing_problems(in_rank0) == []  # the objects themselves: anything goes
        child = AsyncGRPOConfig(model_name_or_path="m", reward_funcs=[main, lam], rollout_process=True)
        [problem] = crossing_problems(child)  # the child runs the script again: only the lambda has no name
        assert "lambda" in str(problem) and "define it with `def`" in str(problem)
        remote = AsyncGRPOConfig(model_name_or_path="m", reward_funcs=[main], rollout_address="127.0.0.1:7000")
        [problem] = crossing_problems(remote)
        assert "cannot import" in str(problem) and "move it into a module" in str(problem)
        module = AsyncGRPOConfig(model_name_or_path="m", reward_funcs=[reference(exact, "reward_funcs")],
                                 rollout_address="127.0.0.1:7000", reward_workers=2)
        assert crossing_problems(module) == []  # an importable module reaches every process
    finally:
        del sys.modules["__main__"].exact_for_test


def _rebound(fn):
    """A copy of `fn` that lives in `__main__` as `exact_for_test` (what a script's own function looks like)."""
    import types

    copy = types.FunctionType(fn.__code__, fn.__globals__, "exact_for_test")
    copy.__module__, copy.__qualname__ = "__main__", "exact_for_test"
    sys.modules["__main__"].exact_for_test = copy
    return copy


def test_parse_args_reads_trl_forms_skips_the_deepspeed_local_rank_and_leaves_the_objects_to_the_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 7\n")
    cfg = parse_args(["--local_rank=3", "--config", str(path), "--lora_target_modules", "q_proj", "v_proj"],
                     learning_rate=1e-3)
    assert (cfg.max_steps, cfg.learning_rate, cfg.lora_target_modules) == (7, 1e-3, ["q_proj", "v_proj"])
    assert cfg.model_name_or_path is None and cfg.reward_funcs is None


def test_callbacks_get_transformers_hooks_state_and_control_and_can_ask_to_stop():
    from transformers import TrainerCallback

    seen = []

    class Recorder(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(("log", state.global_step, logs["train/reward"], kwargs["optimizer"]))

        def on_step_end(self, args, state, control, **kwargs):
            seen.append(("step", state.global_step))
            control.should_training_stop = state.global_step == 2

    callbacks = Callbacks([Recorder()])
    callbacks.begin(AsyncGRPOConfig(max_steps=5), step=0, is_main=True, is_local_main=True, optimizer="opt")
    callbacks.step_end(1)
    callbacks.log({"train/reward": 0.5}, 1)
    assert not callbacks.stop_requested
    callbacks.step_end(2)
    assert callbacks.stop_requested
    assert seen == [("step", 1), ("log", 1, 0.5, "opt"), ("step", 2)]
    assert callbacks.state.log_history == [{"train/reward": 0.5, "step": 1}]
    assert not Callbacks() and not Callbacks().stop_requested


def test_a_script_run_again_by_a_child_that_builds_the_trainer_outside_its_main_guard_is_stopped(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        from asyncgrpo import AsyncGRPOTrainer
        AsyncGRPOTrainer(model="toy")
    """))
    code = ("import multiprocessing.spawn as s, sys; "
            f"s.prepare({{'init_main_from_path': {str(script)!r}}})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-2000:]


class Env:
    def reset(self, **row):
        return "go"


def test_trl_forms_an_environment_without_a_dataset_and_evaluation_set_in_args_with_the_data_given_to_the_trainer(
        tmp_path):
    cfg = AsyncGRPOTrainer(model="m", args=args(tmp_path), environment_factory=Env).args
    assert (cfg.dataset_name, cfg.environment_factory) == ("environment", f"{__name__}:Env")
    config = AsyncGRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5)  # as GRPOConfig is built
    cfg = AsyncGRPOTrainer(model="m", reward_funcs=exact, args=config, train_dataset="d.jsonl",
                           eval_dataset="held.jsonl").args
    assert (cfg.eval_dataset, cfg.eval_steps) == ("held.jsonl", 5)
    # without eval_dataset the held-out prompts are dataset_test_split's (checked when the data is read); an
    # environment has no dataset to take them from, which the trainer refuses when it is built
    assert AsyncGRPOTrainer(model="m", reward_funcs=exact, args=config, train_dataset="d.jsonl").args.eval_dataset is None
    with pytest.raises(ConfigError, match="is required with eval_strategy: steps"):
        AsyncGRPOTrainer(model="m", args=config, environment_factory=Env)
