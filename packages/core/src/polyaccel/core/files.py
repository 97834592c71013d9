"""Replacing a file so that a kill, a power loss or a hostile neighbour loses nothing."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path


def fsync_dir(path: str | os.PathLike | bytes) -> None:
    """Make a rename inside the folder ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def missing_dirs(path: str | os.PathLike) -> list[Path]:
    """``path`` and those of its parents that do not exist yet (what writing into ``path``
    creates), innermost first: what :func:`remove_empty_dirs` takes away again after a failure."""
    missing = []
    for p in (Path(path), *Path(path).parents):
        if os.path.lexists(p):
            break
        missing.append(p)
    return missing


def remove_empty_dirs(dirs: Sequence[str | os.PathLike]) -> None:
    """Remove each of ``dirs`` (innermost first) that is an empty directory; leave the others
    (a folder that now holds something, and so every folder above it)."""
    for d in dirs:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def real_path(path: str | os.PathLike) -> Path:
    """``Path(path).resolve()`` that never raises on a symbolic-link loop (Python 3.11's raises
    ``RuntimeError``): the looping part is left unresolved, and whatever then opens the path
    fails with ``ELOOP``, an ``OSError`` that callers already report."""
    return Path(os.path.realpath(path))


def read_regular(path: str | os.PathLike, limit: int) -> bytes | None:
    """The bytes of ``path`` when it is a regular file (not a link, FIFO, socket or device) of
    at most ``limit`` bytes, else None: reading a file a user or an attacker may have put there
    never blocks on a FIFO nor reads an endless device into memory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
        return data if len(data) <= limit else None
    finally:
        os.close(fd)


def sha256_of(f, chunk: int = 4 << 20) -> str:  # noqa: ANN001
    """SHA-256 (hex) of what is left to read in the binary file ``f``, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def is_regular(path: str | os.PathLike) -> bool:
    """Whether ``path`` itself (a link is not followed) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def replace_file(path: str | os.PathLike | bytes, data: bytes) -> None:
    """Atomically make ``path`` hold ``data``: written to a new, uniquely named file beside it
    (never through an existing file or link, whatever its name), synced, renamed over ``path``,
    and the folder synced. A kill leaves the old contents or the new, never a mix. The file
    keeps ``path``'s permission bits, or gets the usual ones (0666 less the umask) when new."""
    _put_file(os.fspath(path), data, os.replace)


def create_file(path: str | os.PathLike | bytes, data: bytes) -> None:
    """Create ``path`` holding ``data``, never replacing anything there (``FileExistsError``):
    written to a new file beside it, synced, then hard-linked into place, so that a kill leaves
    no file or the whole one, never a cut file a rerun would take for finished (a kill between
    the link and the clean-up can leave the hidden temporary). Where the file system has no
    hard links: created with ``O_EXCL`` and written in place (removed again on an error)."""
    path = os.fspath(path)
    try:
        _put_file(path, data, _link_new)
    except _NoHardLinks:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            with open(fd, "wb") as f:
                f.write(data)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)  # ours: O_EXCL created it
            raise


class _NoHardLinks(OSError):
    """The file system refused a hard link (FAT, some network file systems)."""


def _link_new(tmp: str | bytes, path: str | bytes) -> None:
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
            raise _NoHardLinks(e.errno, e.strerror) from e
        raise
    os.unlink(tmp)


def _put_file(path: str | bytes, data: bytes, put) -> None:  # noqa: ANN001
    """``data`` into a new, synced file beside ``path``, then ``put(tmp, path)`` moves it there."""
    folder, name = os.path.split(path)
    fd, tmp = _new_beside(folder, name, _mode_of(path))
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        put(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder or ".")


NAME_MAX = 255  # bytes in one file name on Linux file systems (ext4, xfs, btrfs, tmpfs)


def fit_name(name: str | bytes, limit: int) -> str | bytes:
    """``name`` cut to at most ``limit`` bytes as the file system sees it (whole characters)."""
    if isinstance(name, bytes):
        return name[:limit]
    while len(os.fsencode(name)) > limit:
        name = name[:-1]
    return name


def _new_beside(folder: str | bytes, name: str | bytes, mode: int | None) -> tuple[int, str | bytes]:
    """A new file ``folder/name.<random>.tmp`` (``name`` cut to fit a file name; ``O_EXCL``: never an existing file or link),
    open for writing; its mode is ``mode``, or 0666 less the umask (the kernel applies it: no
    ``os.umask`` call, which would open a window where other threads create files with no
    umask at all)."""
    dot, suffix = (b".", b".tmp") if isinstance(name, bytes) else (".", ".tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    stem = fit_name(name, NAME_MAX - len(".000000000000.tmp"))
    for _ in range(tempfile.TMP_MAX):
        token = secrets.token_hex(6)
        tmp = os.path.join(folder, stem + dot + (token.encode() if isinstance(name, bytes) else token) + suffix)
        try:
            fd = os.open(tmp, flags, 0o600 if mode is not None else 0o666)
        except FileExistsError:
            continue
        if mode is not None:
            try:
                os.fchmod(fd, mode)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
        return fd, tmp
    raise FileExistsError(errno.EEXIST, f"no free temporary name beside {name!r}")


def _mode_of(path: str | bytes) -> int | None:
    """The permission bits of the existing ``path`` (None when there is none)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return None
