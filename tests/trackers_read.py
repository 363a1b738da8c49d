"""Reading back what a run left in each tracker, without a network: TensorBoard event files, a wandb offline run
(its `.wandb` file: wandb's record log of protobuf records, 32 KiB blocks), and trackio's local SQLite database."""

from __future__ import annotations

import json
import sqlite3
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_RECORD_HEADER = struct.Struct("<IHB")  # checksum, length, type (1 full, 2 first, 3 middle, 4 last)
_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic, version


def wandb_records(path: Path) -> list:
    """Every protobuf Record in a `.wandb` file, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    data = path.read_bytes()
    ident, _, _ = _FILE_HEADER.unpack_from(data)
    assert ident == b":W&B", ident
    pos, records, pending = _FILE_HEADER.size, [], b""
    while pos + _RECORD_HEADER.size <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _RECORD_HEADER.size:  # the block's tail is padding
            pos += left_in_block
            continue
        _, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        if length == 0 and kind == 0:
            break
        start = pos + _RECORD_HEADER.size
        pending += data[start:start + length]
        pos = start + length
        if kind in (1, 4):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    """The rows a wandb offline run logged (`wandb.log` calls), each {key: value} with values as logged."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


def wandb_run_dir(output_dir: Path) -> Path:
    (run,) = (Path(output_dir) / "wandb").glob("offline-run-*")
    return run


def trackio_logs(trackio_dir: Path, project: str) -> list[tuple[str, int, dict]]:
    """(run name, step, metrics) of every row trackio logged for `project`, in order."""
    with sqlite3.connect(Path(trackio_dir) / f"{project}.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    return [(name, step, json.loads(metrics)) for name, step, metrics in rows]
