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


def current_umask() -> int:
    """This process's umask, read without changing it where Linux shows it (/proc/self/status), else by setting and
    restoring it (which another thread creating a file at that instant would see)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o077)
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode a new file gets under the current umask (0644 under the usual 022, 0600 under 077)."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode a new directory gets under the current umask (0755 under 022, 0700 under 077)."""
    return 0o777 & ~current_umask()
