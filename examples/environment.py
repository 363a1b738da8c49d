"""An environment class (TRL's `environment_factory` contract): one instance per episode, `reset(**row)` at its start,
its public methods as the model's tools, `get_reward()` as a reward.

    # GPU node, against its inference node:
    accelerate launch --config_file launch/accelerate/fsdp2.yaml examples/environment.py \
        --model_name_or_path Qwen/Qwen2.5-1.5B-Instruct --vllm_server_base_url http://VLLM_NODE:8000
    # this machine: one process, a model directory whose tokenizer has a tool-calling chat template
    python examples/environment.py --model_name_or_path MODEL_DIR --vllm_server_base_url http://127.0.0.1:8000 \
        --max_steps 2

No dataset (TRL's form): `reset()` returns each episode's task. docs/agents.md has the contract.
"""

import random

from peft import LoraConfig

from asyncgrpo import AsyncGRPOTrainer, parse_args


class Vault:
    """A vault with a hidden 2-digit code; the model may try codes with `lookup` (the tool name the toy chat format
    calls) and is told higher or lower."""

    def __init__(self):
        self.rng = random.Random()
        self.code, self.tries, self.opened = "", 0, False

    def reset(self, **row) -> str:
        self.code, self.tries, self.opened = f"{self.rng.randrange(100):02d}", 0, False
        return "Open the vault: try 2-digit codes with lookup."

    def lookup(self, key: str) -> str:
        """Try a code on the vault.

        Args:
            key: the 2-digit code to try
        """
        self.tries += 1
        guess = key.strip()
        if guess == self.code:
            self.opened = True
            return "open"
        return "higher" if guess < self.code else "lower"

    def get_reward(self) -> float:
        return 1.0 / self.tries if self.opened else 0.0


def main():
    args = parse_args(max_turns=4, max_completion_length=64, num_generations=4,
                      per_device_train_batch_size=8, learning_rate=1e-5, max_steps=100, output_dir="runs/vault")
    AsyncGRPOTrainer(model=args.model_name_or_path, args=args, environment_factory=Vault,
                     peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).train()


if __name__ == "__main__":
    main()
