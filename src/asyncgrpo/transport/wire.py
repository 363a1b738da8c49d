"""What crosses the pipe between the trainer and its rollout process (transport/process.py): batches in a compact
binary form, and exceptions rebuilt with their type and message.

`encode_groups`/`decode_groups`: a small pickled header, then flat numpy buffers (nothing pickled per token).
`pack_exception`/`rebuild_exception`: an instance of the same class with the same args and message, the child's
traceback as a note, or a RolloutProcessError saying the same. The byte layout and its measured cost:
docs/rollout-internals.md.
"""

from __future__ import annotations

import importlib
import pickle
import struct

import numpy as np

from asyncgrpo.errors import RolloutProcessError
from asyncgrpo.contracts import Group

_LENGTH = struct.Struct("<I")
_FORMAT = 1  # bumped if the layout changes: parent and child always run the same code, so this only asserts it


def _flat(rows, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Ragged rows -> (one flat array, the length of each row)."""
    lengths = np.fromiter((len(r) for r in rows), dtype="<i4", count=len(rows))
    flat = np.fromiter((x for r in rows for x in r), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def encode_groups(groups: list[Group]) -> bytes:
    """`groups` as one compact binary blob (module docstring); `decode_groups` gives them back."""
    completions = [c for g in groups for c in g.completion_ids]
    logprobs = [lp for g in groups for lp in g.behaviour_logprobs]
    part_values, part_present = [], []
    for g in groups:
        for name in g.reward_parts:
            values = g.reward_parts[name]
            part_values.extend(0.0 if v is None else v for v in values)
            part_present.extend(v is not None for v in values)
    arrays: dict[str, np.ndarray] = {}
    arrays["prompt_ids"], arrays["prompt_lens"] = _flat([g.prompt_ids for g in groups], "<i4")
    arrays["completion_ids"], arrays["completion_lens"] = _flat(completions, "<i4")
    arrays["logprobs"], arrays["logprob_lens"] = _flat(logprobs, "<f4")
    arrays["n_completions"] = np.array([len(g.completion_ids) for g in groups], dtype="<i4")
    arrays["rewards"] = np.array([r for g in groups for r in g.rewards], dtype="<f8")
    arrays["advantages"] = np.array([a for g in groups for a in g.advantages], dtype="<f8")
    arrays["masked"] = np.array([m for g in groups for m in g.masked], dtype="u1")
    arrays["version"] = np.array([g.version for g in groups], dtype="<i8")
    arrays["index"] = np.array([g.index for g in groups], dtype="<i8")
    # An episode's per-token loss mask and versions, one entry per completion token (groups without: nothing).
    arrays["loss_mask"] = _flat([m for g in groups for m in g.loss_mask], "u1")[0]
    arrays["token_versions"] = _flat([v for g in groups for v in g.versions], "<i8")[0]
    arrays["part_values"] = np.array(part_values, dtype="<f8")
    arrays["part_present"] = np.array(part_present, dtype="u1")
    header = {"format": _FORMAT,
              "groups": [(g.prompt, g.adapter, list(g.finish_reasons), list(g.reward_parts), len(g.masked),
                          [len(v) for v in g.reward_parts.values()], bool(g.loss_mask), bool(g.versions))
                         for g in groups],
              "arrays": [(name, a.dtype.str, a.size) for name, a in arrays.items()]}
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    return b"".join([_LENGTH.pack(len(head)), head, *(a.tobytes() for a in arrays.values())])


def decode_groups(blob: bytes) -> list[Group]:
    """The groups `encode_groups` wrote into `blob`."""
    (size,) = _LENGTH.unpack_from(blob, 0)
    header = pickle.loads(blob[_LENGTH.size:_LENGTH.size + size])
    assert header["format"] == _FORMAT, header["format"]
    offset, a = _LENGTH.size + size, {}
    for name, dtype, count in header["arrays"]:
        a[name] = np.frombuffer(blob, dtype=np.dtype(dtype), count=count, offset=offset)
        offset += a[name].nbytes
    assert offset == len(blob), (offset, len(blob))
    prompt_ids = _split(a["prompt_ids"], a["prompt_lens"])
    completion_ids = _split(a["completion_ids"], a["completion_lens"])
    logprobs = _split(a["logprobs"], a["logprob_lens"])
    rewards, advantages = a["rewards"].tolist(), a["advantages"].tolist()
    masked, parts, present = a["masked"].astype(bool).tolist(), a["part_values"].tolist(), a["part_present"].tolist()
    flat_mask, flat_versions = a["loss_mask"].tolist(), a["token_versions"].tolist()
    groups, c, m, p, t, v = [], 0, 0, 0, 0, 0  # cursors: completion, mask, reward part, loss mask, version
    for i, (prompt, adapter, finish, names, n_masked, part_lens, has_mask, has_versions) in enumerate(
            header["groups"]):
        n = int(a["n_completions"][i])
        reward_parts = {}
        for name, length in zip(names, part_lens):
            reward_parts[name] = [v if ok else None for v, ok in zip(parts[p:p + length], present[p:p + length])]
            p += length
        groups.append(Group(prompt=prompt, prompt_ids=prompt_ids[i], completion_ids=completion_ids[c:c + n],
                            behaviour_logprobs=logprobs[c:c + n], rewards=rewards[c:c + n],
                            reward_parts=reward_parts, advantages=advantages[c:c + n], version=int(a["version"][i]),
                            adapter=adapter, finish_reasons=finish, index=int(a["index"][i]),
                            masked=masked[m:m + n_masked]))
        lengths = [len(ids) for ids in completion_ids[c:c + n]]
        if has_mask:
            groups[-1].loss_mask, t = _take(flat_mask, t, lengths)
        if has_versions:
            groups[-1].versions, v = _take(flat_versions, v, lengths)
        c, m = c + n, m + n_masked
    return groups


def _take(values: list, start: int, lengths: list[int]) -> tuple[list[list], int]:
    """Rows of `lengths` from `values` at `start`, and where the next row starts."""
    out = []
    for n in lengths:
        out.append(values[start:start + n])
        start += n
    return out, start


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[list]:
    values, out, start = flat.tolist(), [], 0
    for n in lengths.tolist():
        out.append(values[start:start + n])
        start += n
    return out


# ---- exceptions ---------------------------------------------------------------------------------------
def _picklable(value) -> bool:
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:  # noqa: BLE001 - anything that does not survive the trip is left out
        return False
    return True


def pack_exception(exc: BaseException, traceback_text: str) -> dict:
    """What the child sends for `exc`: plain data that always pickles (module docstring)."""
    cls = type(exc)
    state = {k: v for k, v in vars(exc).items() if _picklable(v)}
    return {"module": cls.__module__, "qualname": cls.__qualname__, "message": str(exc),
            "args": exc.args if _picklable(exc.args) else None, "state": state, "traceback": traceback_text}


def rebuild_exception(payload: dict) -> BaseException:
    """The exception `payload` describes, as its own class where that can be rebuilt saying the same thing, else a
    RolloutProcessError with its type, message and traceback."""
    try:
        exc = _rebuild(payload)
    except Exception:  # noqa: BLE001 - any failure to rebuild falls back to the message
        exc = RolloutProcessError(f"the rollout process raised {payload['module']}.{payload['qualname']}: "
                                  f"{payload['message']}\n--- its traceback in the rollout process ---\n"
                                  f"{payload['traceback']}")
    else:
        exc.add_note(f"--- raised in the rollout process ---\n{payload['traceback'].rstrip()}")
    return exc


def _rebuild(payload: dict) -> BaseException:
    """The same class with the same args and attributes, without running its __init__ (the project's exceptions
    take other constructor arguments than the args they store: ConfigError(field, problem, fix))."""
    cls = importlib.import_module(payload["module"])
    for part in payload["qualname"].split("."):
        cls = getattr(cls, part)  # a class defined inside a function ("<locals>") fails here
    if not (isinstance(cls, type) and issubclass(cls, BaseException)) or payload["args"] is None:
        raise TypeError(f"cannot rebuild {payload['qualname']}")
    exc = cls.__new__(cls, *payload["args"])
    BaseException.__init__(exc, *payload["args"])
    exc.__dict__.update(payload["state"])
    if str(exc) != payload["message"]:
        raise ValueError("the rebuilt exception does not say the same thing")
    return exc
