"""The results JSONL of ``polyaccel-asr transcribe``: telling it from other files, reading it
with bounded memory, repairing and appending to it, and the lock that keeps two runs off it.

Each line is one JSON object with at least ``path``, ``text``, ``duration_s`` and ``error``.
A path that is not valid UTF-8 (a file name in another encoding, which Python holds with
surrogate escapes) is written readable in ``path`` (undecodable bytes as ``\\xNN``) and exactly
in ``path_bytes`` (base64 of the raw bytes); :func:`record_path` gives the original back.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from polyaccel.core.clitools import json_safe, printable  # noqa: F401  (printable: imported from here too)
from polyaccel.core.files import NAME_MAX, fit_name, replace_file

MAX_LINE_BYTES = 16 << 20  # far above any real line (a 2 h transcript is ~100 kB)
RECORD_FIELDS = ("path", "text", "duration_s", "error")
FSYNC_INTERVAL_S = 1.0


class NotResultsFile(ValueError):
    """An existing file that is not a results JSONL: it is never modified."""


class OutputBusy(RuntimeError):
    """Another run holds the lock on this output."""


# ---- paths ------------------------------------------------------------------------------------


def path_key(path: str) -> str:
    """What resume and de-duplication compare: the absolute path with symlinked directories
    resolved. The file's own name is kept, so a symlink to a file stays an input of its own."""
    head, tail = os.path.split(os.path.join(os.getcwd(), os.fspath(path)))
    return os.path.join(os.path.realpath(head), tail)


def file_name_problem(path: str) -> str | None:
    """Why no file can have ``path`` as its name (None if one can): a NUL character, or a lone
    surrogate that stands for no byte (a JSON ``\\ud800`` escape; ``\\udc80``-``\\udcff`` are the
    bytes of a name that is not UTF-8, as Python holds them). Every file call would raise on it."""
    if "\x00" in path:
        return "holds a NUL character"
    try:
        os.fsencode(path)
    except UnicodeEncodeError:
        return "holds a lone surrogate that is no byte of a file name"
    return None


_PATH_FIELDS = ("path", "cwd")
"""Fields holding file system paths: the input, and for an input named by a relative path the
working directory of the run that wrote it."""


def encode_path(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as written: a path that is not valid UTF-8 gets a readable ``path`` (``cwd``)
    and an exact ``path_bytes`` (``cwd_bytes``)."""
    out = record
    for field in _PATH_FIELDS:
        value = record.get(field)
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
            continue
        except UnicodeEncodeError:
            raw = os.fsencode(value)
        out = dict(out) if out is record else out
        out[field] = raw.decode("utf-8", "backslashreplace")
        out[f"{field}_bytes"] = base64.b64encode(raw).decode("ascii")
    return out


def _decoded(record: dict[str, Any], field: str) -> str | None:
    raw = record.get(f"{field}_bytes")
    if isinstance(raw, str):
        try:
            return os.fsdecode(base64.b64decode(raw, validate=True))
        except ValueError:
            pass
    value = record.get(field)
    return None if value is None else str(value)


def record_path(record: dict[str, Any]) -> str:
    """The path a record was written for, as its run was given it (inverse of :func:`encode_path`)."""
    return str(_decoded(record, "path"))


def record_file(record: dict[str, Any]) -> str:
    """The record's input as a path from here: a relative path joined to the ``cwd`` of the run
    that wrote it (records from before that field: taken from the current directory)."""
    path, cwd = record_path(record), _decoded(record, "cwd")
    return os.path.join(cwd, path) if cwd else path


def record_key(record: dict[str, Any]) -> str:
    """:func:`path_key` of the record's input (:func:`record_file`)."""
    return path_key(record_file(record))


def with_run_dir(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as a run writes it: an input named by a relative path also records the run's
    working directory (``cwd``), so a rerun from another directory never takes other files of
    the same relative names for done."""
    path = record.get("path")
    if not isinstance(path, str) or os.path.isabs(path) or "cwd" in record:
        return record
    return {**record, "cwd": os.getcwd()}


def dumps(record: dict[str, Any]) -> bytes:
    """One line of the results file. Stray surrogates in other fields (an error message that
    quotes an odd file name) become JSON ``\\uXXXX`` escapes instead of failing the write; NaN
    and infinities become ``null`` (strict JSON)."""
    line = json.dumps(json_safe(encode_path(record)), ensure_ascii=False, allow_nan=False) + "\n"
    return line.encode("utf-8", "backslashreplace")


# ---- reading ----------------------------------------------------------------------------------


def _lines(f: Any) -> Iterator[tuple[int, bytes | None, bool]]:
    """(line number, line or None when longer than :data:`MAX_LINE_BYTES`, ends with a
    newline); memory is bounded by that limit however the file looks."""
    limit = MAX_LINE_BYTES
    lineno = 0
    while line := f.readline(limit + 1):
        lineno += 1
        if len(line) > limit and not line.endswith(b"\n"):
            while line and not line.endswith(b"\n"):
                line = f.readline(limit + 1)
            yield lineno, None, True
            continue
        yield lineno, line, line.endswith(b"\n")


def _parse(line: bytes, fields: tuple[str, ...]) -> dict[str, Any] | None:
    """The record on ``line`` if it is an object with ``fields`` and a string path (and ``cwd``,
    where it has one) that a file can have (:func:`file_name_problem`: no run writes one, and
    every file call would raise on it), else None."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # also invalid UTF-8, or nested deeper than json parses
        return None
    if isinstance(rec, dict) and all(k in rec for k in fields) and isinstance(rec.get("path"), str):
        cwd = _decoded(rec, "cwd")
        names = [record_path(rec), *([cwd] if cwd else [])]
        return rec if all(file_name_problem(name) is None for name in names) else None
    return None


def _is_torn(line: bytes, complete: bool, after_records: bool) -> bool:
    """A last line cut off by a kill: no newline, the start of one of our records (zero bytes
    after it are the unwritten end of the file after a power loss), and whole records before
    it. A file whose only line is cut is refused: a user's one-line JSON file without a final
    newline (what ``json.dump`` writes), or a file of zero bytes, would look the same."""
    head = b'{"path": '
    line = line.rstrip(b"\0")
    return not complete and after_records and (line.startswith(head) or head.startswith(line))


@dataclasses.dataclass(slots=True)
class ResultsScan:
    """What an existing results file holds. ``clean``: appending to it as it is is safe (it
    ends with a newline and has no torn or foreign lines)."""

    records: list[dict[str, Any]]
    clean: bool


def scan_results(path: str | os.PathLike, strict: bool = True,
                 fields: tuple[str, ...] | None = None) -> ResultsScan:
    """Read a results file. ``strict``: raise :class:`NotResultsFile` at the first line that
    is neither a full record, a blank line nor a torn last line; else skip such lines. A
    record is an object with ``fields`` (default: :data:`RECORD_FIELDS` when strict, else
    ``path`` alone)."""
    fields = fields or (RECORD_FIELDS if strict else ("path",))
    records: list[dict[str, Any]] = []
    clean = True
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO must not block the open
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotResultsFile("not a regular file")
    with open(fd, "rb") as f:
        for lineno, line, complete in _lines(f):
            if line is not None and not line.strip():
                clean = clean and complete
                continue
            rec = _parse(line, fields) if line is not None else None
            if rec is not None:
                records.append(rec)
                clean = clean and complete
                continue
            clean = False
            if strict and not (line is not None and _is_torn(line, complete, bool(records))):
                what = f"longer than {MAX_LINE_BYTES} bytes" if line is None else "not a results record"
                raise NotResultsFile(f"line {lineno} is {what}")
    return ResultsScan(records, clean)


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All well-formed result records in a results file (other lines skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    return scan_results(p, strict=False).records


def completed(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a resumed run keeps: without an error, the first one per :func:`path_key`."""
    seen: set[str] = set()
    kept = []
    for rec in records:
        key = record_key(rec)
        if not rec.get("error") and key not in seen:
            seen.add(key)
            kept.append(rec)
    return kept


def kept_on_resume(records: Iterable[dict[str, Any]], retried: set[str] | None) -> list[dict[str, Any]]:
    """What a resumed file keeps, in file order: one record per input, its first good one;
    an input's failed record only if it is not among ``retried`` (the :func:`path_key` of
    every input of this run, which tries its failed ones again; None: all of them)."""
    good = {record_key(r) for r in records if not r.get("error")}
    seen: set[str] = set()
    kept = []
    for rec in records:
        key = record_key(rec)
        if key in seen or (rec.get("error") and (key in good or retried is None or key in retried)):
            continue
        seen.add(key)
        kept.append(rec)
    return kept


def one_per_input(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per input (:func:`path_key`), in first-seen order: its first good one, else
    its first failed one. A resumed (or concatenated) file may hold an input's failed line and,
    later, its good one, or the same input twice."""
    best: dict[str, dict[str, Any]] = {}
    for rec in records:
        key = record_key(rec)
        if key not in best or (best[key].get("error") and not rec.get("error")):
            best[key] = rec
    return list(best.values())


# ---- writing ----------------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _replace_with(path: Path, records: list[dict[str, Any]]) -> None:
    """Atomically replace ``path`` by ``records``: a kill or power loss leaves the old file or
    the new one, never a mix (:func:`polyaccel.core.files.replace_file`)."""
    replace_file(path, b"".join(dumps(r) for r in records))


class ResultsWriter:
    """Appends one JSON line per result to ``path`` (one ``write`` call each, so a killed process
    leaves whole lines) and fsyncs at most every :data:`FSYNC_INTERVAL_S` seconds and on close.

    ``resume=True`` (the default) first repairs an existing file: it keeps one record per
    file, the first without an error (:func:`kept_on_resume`), and drops the rest (a torn last
    line, duplicates, and the failed records of ``retried``: the :func:`path_key` of this run's
    inputs, whose failed files it tries again; None, every failed record); it is rewritten
    only when something is dropped. A file that is not a results file raises
    :class:`NotResultsFile` and is left as it was. :attr:`done` holds the paths kept without
    an error. ``resume=False`` starts the file afresh.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = True, retried: Iterable[str] | None = None):
        self.path = Path(path)
        self.done: set[str] = set()
        if resume and self.path.exists():
            scan = scan_results(self.path, fields=("path",))
            kept = kept_on_resume(scan.records, None if retried is None else set(retried))
            self.done = {record_path(r) for r in kept if not r.get("error")}
            if len(kept) != len(scan.records) or not scan.clean:
                _replace_with(self.path, kept)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if resume else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._synced = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line."""
        assert self._fd is not None, "writer is closed"
        _write_all(self._fd, dumps(with_run_dir(record)))
        if time.monotonic() - self._synced >= FSYNC_INTERVAL_S:
            os.fsync(self._fd)
            self._synced = time.monotonic()

    def close(self) -> None:
        """Fsync and close (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the output: checks and lock --------------------------------------------------------------


def output_problem(path: str, protected: Iterable[str]) -> str | None:
    """Why ``path`` must not be written (None if it may): a directory, a device, FIFO or
    socket, the same file as one of ``protected`` (the inputs, manifests, references), or a
    file with other hard links (their runs would take other locks, and a resume's repair,
    which renames a new file over this name, would part them)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        return f"cannot use it: {e.strerror}"
    if st is not None and stat.S_ISDIR(st.st_mode):
        return "is a directory"
    if st is not None and not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a device, FIFO or socket); results go to a regular file"
    real = os.path.realpath(path)
    for p in protected:
        if os.path.realpath(p) == real or (st is not None and _same_inode(p, st)):
            return f"is an input ({p}); refusing to overwrite it, even with --overwrite"
    if st is not None and st.st_nlink > 1:
        return (f"has {st.st_nlink} hard links; a results file must have one name (runs under two names "
                "would not lock each other out): copy it, or remove the other links")
    return None


def _same_inode(path: str, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


LOCK_SUFFIX = ".polyaccel-asr.lock"
"""Not ``.lock``: ``flock OUT.lock polyaccel-asr ... -o OUT`` (a cron job's usual guard) would
hold our lock against us, and a user's own ``OUT.lock`` must never be touched."""


def lock_name(output: str) -> str:
    """``output +`` :data:`LOCK_SUFFIX`, or, where that name would be longer than a file name
    can be (255 bytes), the output's name cut short with 12 hex digits of its hash: the same
    for every run."""
    folder, name = os.path.split(output)
    if len(os.fsencode(name + LOCK_SUFFIX)) <= NAME_MAX:
        return output + LOCK_SUFFIX
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:12]
    return os.path.join(folder, f"{fit_name(name, NAME_MAX - len('.000000000000' + LOCK_SUFFIX))}.{digest}{LOCK_SUFFIX}")


LOCK_HEADER = "polyaccel-asr lock, pid "
"""How a lock file starts (then the holder's process id): a file on the lock path that does
not is a user's, never truncated or removed."""


class OutputLock:
    """An exclusive ``flock`` on ``<output>``:data:`LOCK_SUFFIX` for the length of one run;
    removed on release. Raises :class:`OutputBusy` if another run holds it (never waits). An
    output name with no room for the suffix gets ``<its start>.<hash of it>``:data:`LOCK_SUFFIX`."""

    def __init__(self, output: str | os.PathLike):
        self.path = Path(lock_name(os.fspath(output)))
        self._fd: int | None = None
        self.left_behind: str | None = None
        """Why :meth:`release` could not remove the lock file (a folder no longer writable), if so:
        the next run takes it over as a lock file a run left."""

    def acquire(self) -> OutputLock:
        """Take the lock or raise OutputBusy (or OSError if the lock file cannot be made)."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise OSError(e.errno, f"{self.path} is a symbolic link, not a lock file of ours; "
                                           "remove it or choose another output") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._refuse_foreign(fd)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputBusy(self._holder()) from None
                raise
            if self._still_linked(fd):
                self._fd = fd
                try:
                    os.ftruncate(fd, 0)
                    _write_all(fd, f"{LOCK_HEADER}{os.getpid()}\n".encode())
                except OSError:  # a full disk: no lock file of ours left behind by a run that never ran
                    self.release()
                    raise
                return self
            os.close(fd)  # the holder removed the file between our open and flock: retry

    def _refuse_foreign(self, fd: int) -> None:
        """Raise OSError when the lock path holds something other than a lock file a run left
        (empty, or :data:`LOCK_HEADER` and one process id): truncating it would destroy a
        user's file, even one that holds only a number."""
        st = os.fstat(fd)
        head = os.pread(fd, 64, 0) if stat.S_ISREG(st.st_mode) and st.st_size <= 64 else b"?"
        if not stat.S_ISREG(st.st_mode) or not re.fullmatch(rb"(" + LOCK_HEADER.encode() + rb"\d+\n?)?", head):
            raise OSError(errno.EEXIST, f"{self.path} exists and is not a lock file of ours; "
                                        "remove it or choose another output")

    def _still_linked(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _holder(self) -> str:
        try:
            pid = self.path.read_text().removeprefix(LOCK_HEADER).strip()
        except (OSError, UnicodeDecodeError):
            pid = ""
        return f"pid {pid}" if pid.isdigit() else "another process"

    def release(self) -> None:
        """Remove the lock file, then drop the lock (in that order, so no run can lock a file
        that is about to vanish)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                self.left_behind = e.strerror or str(e)
            finally:
                os.close(fd)

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
