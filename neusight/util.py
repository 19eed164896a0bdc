"""Small helpers shared by the package: atomic file writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from neusight.errors import InputError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so no half-written file is left."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (parent folders created); a path that cannot be written is an
    InputError naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise InputError(f"cannot write {str(path)!r}: {e.strerror or e}. Fix: give a path in a folder you can "
                         "write to") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600 files; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        with __import__("contextlib").suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
