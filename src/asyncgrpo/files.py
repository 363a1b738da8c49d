"""File helpers shared by the adapter store, the checkpoints and the adapter receiver.

Standard library only: the receiver runs beside vLLM, where torch need not be importable.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

HASH_CHUNK = 1 << 20  # bytes read at a time while hashing


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in chunks (adapters and optimizer states can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory: so that a rename into it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
