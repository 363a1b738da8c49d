"""Reward functions and a stand-in tokenizer for tests/security/test_workers.py, loaded by reference in reward worker
processes (the test puts this directory on sys.path, which workers take from the parent)."""

import os
from pathlib import Path

SECRETS = ("ASYNCGRPO_VLLM_API_KEY", "ASYNCGRPO_ROLLOUT_KEY", "VLLM_API_KEY")
VISIBLE = "ASYNCGRPO_TEST_VISIBLE"  # an ordinary variable: workers keep it


def secrets_seen(prompts, completions, **columns):
    """How many of the secret variables, or their values, this process can read: os.environ, and the environment
    block the process was started with (/proc/self/environ, which unsetting a variable does not clear)."""
    start_block = Path("/proc/self/environ").read_bytes() if Path("/proc/self/environ").exists() else b""
    seen = sum(name in os.environ or name.encode() in start_block or b"s3cret-" in start_block for name in SECRETS)
    return [float(seen)] * len(completions)


def visible_seen(prompts, completions, **columns):
    """1.0 where the ordinary variable reached the worker (the function does read its environment)."""
    return [float(os.environ.get(VISIBLE) == "yes")] * len(completions)


def same_process(prompts, completions, **columns):
    """This process's id, to tell a worker from the test process."""
    return [float(os.getpid())] * len(completions)


class DigitTokenizer:
    """A stand-in tokenizer (ids 0-9 are the digits), loaded as TokenizerRef loads a real one."""

    @classmethod
    def from_pretrained(cls, directory):
        return cls()

    def __len__(self):
        return 10

    def decode(self, ids, skip_special_tokens=True):
        return "".join(str(i) for i in ids)
