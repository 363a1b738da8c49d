"""GRPO with a LoRA adapter on grade-school math, written as a TRL user writes it (asyncgrpo's Python API).

    # GPU node, against an inference node serving the base model (launch/vllm/serve.sh):
    accelerate launch --config_file launch/accelerate/fsdp2.yaml examples/math_lora.py \
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --vllm_server_base_url http://VLLM_NODE:8000
    # this machine: the toy model against a local vLLM CPU server (README, "Running it yourself"):
    ACCELERATE_USE_CPU=true accelerate launch --config_file launch/accelerate/ddp_cpu.yaml examples/math_lora.py \
        --model_name_or_path toy --vllm_server_base_url http://127.0.0.1:8000 \
        --max_completion_length 4 --per_device_train_batch_size 16 --max_steps 5

Any config key is a `--key value` (docs/configuration.md). With `toy` the prompts are the toy task's ("07,45>"
-> "45"), built here, because this machine has no hub; otherwise GSM8K from the hub.
"""

import os
import re

from datasets import Dataset, load_dataset
from peft import LoraConfig
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer, parse_args


def correct_answer(completions, answer, **kwargs):
    """1.0 where the completion's last number equals the reference answer, else 0.0 (TRL's reward signature).
    Defined at the top level, so reward worker processes (`--reward_workers N`) can import it."""
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion  # chat or plain text
        numbers = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
        rewards.append(1.0 if numbers and float(numbers[-1]) == float(reference) else 0.0)
    return rewards


def gsm8k(split: str) -> Dataset:
    """GSM8K as chat prompts, with the number after `####` as the `answer` column."""
    data = load_dataset("openai/gsm8k", "main", split=split)
    return data.map(lambda row: {"prompt": [{"role": "user", "content": row["question"]}],
                                 "answer": row["answer"].split("####")[-1].strip().replace(",", "")},
                    remove_columns=data.column_names)


def toy_math(n: int, seed: int) -> Dataset:
    """Which of two numbers is larger, in the toy model's format (plain-text prompts)."""
    import random

    rng = random.Random(seed)
    pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(n)]
    return Dataset.from_list([{"prompt": f"{a:02d},{b:02d}>", "answer": f"{max(a, b):02d}"} for a, b in pairs])


class PrintReward(TrainerCallback):
    """A transformers callback: the mean reward of each logged step and each evaluation, on rank 0."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step}: reward {logs['train/reward']:.3f}", flush=True)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        print(f"step {state.global_step}: eval {metrics}", flush=True)


def main():
    args = parse_args(learning_rate=1e-5, max_steps=200, num_generations=8, max_completion_length=512,
                      output_dir="runs/math-lora")
    toy = args.model_name_or_path == "toy"
    train, held_out = (toy_math(256, seed=0), toy_math(32, seed=1)) if toy else (gsm8k("train"), gsm8k("test"))
    trainer = AsyncGRPOTrainer(
        model=args.model_name_or_path,
        reward_funcs=[correct_answer],
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"]),
        callbacks=[PrintReward()],
    )
    result = trainer.train()  # the adapter lands in args.output_dir (PEFT format)
    if os.environ.get("RANK", "0") == "0":  # a transformers TrainOutput, as TRL's train() returns
        print(f"trained to step {result.global_step}, mean loss {result.training_loss:.6g}", flush=True)


if __name__ == "__main__":  # reward workers and the rollout process run this file again to import correct_answer
    main()
