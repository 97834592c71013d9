"""Replacing a file so that a kill, a power loss or a hostile neighbour loses nothing."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile


def fsync_dir(path: str | os.PathLike | bytes) -> None:
    """Make a rename inside the folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike | bytes, data: bytes) -> None:
    """Atomically make ``path`` hold ``data``: written to a new, uniquely named file beside it
    (never through an existing file or link, whatever its name), synced, renamed over ``path``,
    and the folder synced. A kill leaves the old contents or the new, never a mix. The file
    keeps ``path``'s permission bits, or gets the usual ones (0666 less the umask) when new."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    dot, suffix = (b".", b".tmp") if isinstance(path, bytes) else (".", ".tmp")
    fd, tmp = tempfile.mkstemp(prefix=name + dot, suffix=suffix, dir=folder or None)
    try:
        try:
            os.fchmod(fd, _mode_for(path))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder or ".")


def _mode_for(path: str | bytes) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
