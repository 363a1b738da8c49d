"""Reward functions for tests/unit/rollout/test_reward_pool.py, loaded by reference (`reward_fns:NAME`) in the
reward worker processes: the test puts this directory on sys.path, which spawned workers inherit."""

import os
import sys
import threading
import zlib


def fingerprint(prompts, completions, trainer_state=None, log_metric=None, log_extra=None, **columns):
    """A value per completion that changes with anything the function receives (the prompt, the completion, every
    column including completion_ids, truncated and parsed): equal results mean equal inputs. TRL's trainer_state,
    log_metric and log_extra are not columns (not one value per completion)."""
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        seen = (prompt, completion, sorted((k, v[i]) for k, v in columns.items()))
        out.append(zlib.crc32(repr(seen).encode()) / 2**32)
    return out


def misbehave(prompts, completions, behave=None, **columns):
    """Does what the row's `behave` column says: ok (0.5 each), raise, hang (forever), crash (os._exit(3)),
    segfault (SIGSEGV, as a crash in native code)."""
    action = behave[0]
    if action == "raise":
        raise ValueError("misbehaving on purpose")
    if action == "hang":
        threading.Event().wait()
    if action == "crash":
        os._exit(3)
    if action == "segfault":
        segfault(prompts, completions)
    return [0.5] * len(completions)


def torch_imported(prompts, completions, **columns):
    """1.0 where torch is loaded in the process that scores (a worker should not need it)."""
    return [float("torch" in sys.modules)] * len(completions)


def segfault(prompts, completions, **columns):
    """Dies of SIGSEGV, as a crash in native code would."""
    import ctypes

    ctypes.string_at(0)


class MisbehavingTokenizer:
    """A stand-in tokenizer (TokenizerRef("never-ready" or a directory, "reward_fns", "MisbehavingTokenizer")) for
    the failures a real tokenizer cannot produce on demand: loading that never ends, and decoding that does what the
    first token id says: 1 hangs, 2 exits (os._exit(3)), 3 closes the worker's pipe and hangs (its process lives on).
    Before hanging it creates `hanging` in its directory, so that a test can wait for the worker to be busy."""

    def __init__(self, directory):
        self.directory = directory

    @classmethod
    def from_pretrained(cls, directory):
        if directory == "never-ready":
            threading.Event().wait()
        return cls(directory)

    def __len__(self):
        return 100

    def decode(self, ids, skip_special_tokens=True):
        action = ids[0] if ids else 0
        if action == 2:
            os._exit(3)
        if action == 3:
            import gc
            from multiprocessing.connection import Connection

            for conn in [o for o in gc.get_objects() if isinstance(o, Connection)]:
                conn.close()
        if action in (1, 3):
            open(os.path.join(self.directory, "hanging"), "w").close()
            threading.Event().wait()
        return "x"


def logs_step(prompts, completions, trainer_state, log_metric, log_extra, **columns):
    """TRL's logging and shaping arguments, from a worker: logs the step it was scored at and one column."""
    log_metric("seen_step", float(trainer_state.global_step))
    log_extra("length", [len(c) for c in completions])
    return [float(trainer_state.policy_version)] * len(completions)
