"""A checkpoint directory is complete or absent.

Every rank writes (and fsyncs) its files under a hidden temporary name next to the target, ``.NAME.partial``;
only when all ranks are done does rank 0 move it into place with ``rename`` (atomic within one file
system) and fsync the parent directory. A crash while writing leaves the previous checkpoint untouched
and a ``.partial`` directory that nothing ever loads (the next save replaces it). Replacing an existing
checkpoint of the same name (``last.ckpt``) takes two renames -- old out of the way to ``.NAME.old``, new in
-- and a crash between them, a window of microseconds, is repaired by :func:`recover` on the next load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def start(path: Path) -> Path:
    """Rank 0, before anyone writes: a fresh, empty temporary directory for ``path``."""
    partial = partial_path(path)
    remove(partial)
    partial.mkdir(parents=True)
    return partial


def commit(path: Path) -> None:
    """Rank 0, once every rank has written and synced its files: the temporary directory becomes ``path``."""
    partial, old = partial_path(path), old_path(path)
    _fsync_dir(partial)
    if path.exists():
        remove(old)
        path.rename(old)
    partial.rename(path)
    _fsync_dir(path.parent)
    remove(old)


def recover(path: Path) -> None:
    """Rank 0: finish a commit that stopped between its two renames (``path`` gone, ``.NAME.old`` whole)."""
    old = old_path(path)
    if not path.exists() and old.exists():
        old.rename(path)
        _fsync_dir(path.parent)


def write_synced(obj: bytes, path: Path) -> None:
    with open(path, "wb") as f:
        f.write(obj)
        f.flush()
        os.fsync(f.fileno())


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
