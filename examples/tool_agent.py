"""A tool-calling agent: each completion is an episode of model turns and `lookup` calls (TRL's `tools`).

    # GPU node, a model that calls tools (its chat template lists them), against its inference node:
    accelerate launch --config_file launch/accelerate/fsdp2.yaml examples/tool_agent.py \
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --vllm_server_base_url http://VLLM_NODE:8000
    # this machine: one process, a model directory whose tokenizer has a tool-calling chat template
    python examples/tool_agent.py --model_name_or_path MODEL_DIR --vllm_server_base_url http://127.0.0.1:8000 \
        --max_steps 2

The model answers "what does KEY lead to?" questions about a small hidden table it can only read through the tool.
Episodes, turns and what is trained on: docs/agents.md.
"""

from datasets import Dataset
from peft import LoraConfig

from asyncgrpo import AsyncGRPOTrainer, parse_args

TABLE = {"amber": "basalt", "basalt": "cobalt", "cobalt": "dune", "dune": "ember", "ember": "flint"}


def lookup(key: str) -> str:
    """Look a key up in the hidden table.

    Args:
        key: the key to look up
    """
    return TABLE.get(key.strip(), f"no entry for {key!r}")


def final_answer(completions, answer, **kwargs):
    """1.0 where the episode's last assistant message names the answer, else 0.0."""
    last = [next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "") for c in completions]
    return [1.0 if a in text else 0.0 for text, a in zip(last, answer)]


def questions() -> Dataset:
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"What does {key} lead to? Use lookup."}],
                               "answer": value} for key, value in TABLE.items()])


def main():
    args = parse_args(max_turns=4, max_completion_length=64, num_generations=4, per_device_train_batch_size=8,
                      learning_rate=1e-5, max_steps=100, output_dir="runs/tool-agent")
    AsyncGRPOTrainer(model=args.model_name_or_path, reward_funcs=final_answer, args=args,
                     train_dataset=questions(), tools=[lookup],
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).train()


if __name__ == "__main__":
    main()
