"""``polyaccel-asr export``: subtitles (SRT, WebVTT) or plain text, one file per input, from a
results JSONL written by ``transcribe``.

Files are named after the input's stem (``clips/a.wav`` -> ``DIR/a.srt``); a file name that is
not valid UTF-8 is rebuilt from the record's ``path_bytes`` so the subtitle sits next to the
right name byte for byte. Two inputs with one stem, in any letter case (``A.wav``, ``a.wav``),
get ``A.srt`` and ``a-2.srt`` on every file system (in record order, each said on stderr). An
existing file is never replaced unless ``--overwrite``, and never when it is one of the
transcribed inputs (audio named ``talk.txt``), the results file, or a file that does not hold
text (audio or other binary data: a relative input path read from another directory finds no
input, but the audio is still not text); a new one is created exclusively
(``O_EXCL``), a replaced one written next to it and renamed over it. The temporary a kill
left beside a file (``a.srt.<12 hex>.tmp``) is removed by the rerun that has that file.
Export remembers the sha256 of each file it writes (:class:`_Exported`); ``--overwrite``
replaces such a file unchanged since, and keeps any other one (a user's own ``talk.srt``, an
export edited since) as ``<name>.bak-<time>`` first, saying so.

A file that already holds exactly what would be written counts as done (a rerun succeeds); a
``-d`` folder the run created is removed again if nothing was written into it.

Exit status: 0 every transcribed input has its file; 1 some could not be written (the record
failed, has no segments for srt/vtt, the file exists with other content, a write error), each
said on stderr; 2 usage error (no such results file, not a results file, ``-d`` is not a
folder), nothing written; 3 nothing written at all and nothing up to date.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import stat
import sys
import unicodedata
from collections.abc import Sequence
from typing import Any

from polyaccel.core.files import NAME_MAX, create_file, fit_name, is_regular, read_regular, replace_file

FORMATS = ("srt", "vtt", "txt")
EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_NOTHING_DONE = 0, 1, 2, 3


# ---- formatting ----------------------------------------------------------------------------------


def _clock(ms: int, sep: str) -> str:
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


MIN_CUE_MS = 500
"""The shortest cue written: a shorter segment (a 1-sample file's is 0 ms, which no player
shows) ends this long after its start, or where the next cue starts if that is sooner."""


def _cues(segments: Sequence[dict[str, Any]]) -> list[tuple[int, int, str]]:
    """(start, end in milliseconds, one-line text) per segment with text to read (not
    punctuation alone); end never before start, and :data:`MIN_CUE_MS` after it where the next
    cue starts no sooner."""
    kept = []
    for s in segments:
        text = " ".join(str(s.get("text", "")).split())  # a blank line inside a cue would end it
        if text and not all(unicodedata.category(c).startswith("P") or c == " " for c in text):
            start = max(0, round(float(s["start"]) * 1000))
            kept.append((start, max(start, round(float(s["end"]) * 1000)), text))
    out = []
    for i, (a, b, text) in enumerate(kept):
        if b - a < MIN_CUE_MS:
            later = [n for n, _, _ in kept[i + 1:] if n > a]
            b = max(b, min([a + MIN_CUE_MS, *later[:1]]))
        out.append((a, b, text))
    return out


def to_srt(segments: Sequence[dict[str, Any]]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each. SRT
    has no escapes and readers take a line holding ``-->`` for a cue's times, so an arrow in
    the text is written ``->``."""
    return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{re.sub('-{2,}>', '->', t)}\n\n"
                   for i, (a, b, t) in enumerate(_cues(segments), 1))


def to_vtt(segments: Sequence[dict[str, Any]]) -> str:
    """WebVTT: the ``WEBVTT`` header, cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``; ``&``, ``<``, ``>``
    escaped (cue text is markup), so ``-->`` cannot appear in a cue."""
    def esc(t: str) -> str:
        return t.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{esc(t)}\n\n"
                                  for a, b, t in _cues(segments))


_SURROGATE = re.compile("[\ud800-\udfff]")


def render(record: dict[str, Any], fmt: str) -> str:
    """The file for one record; ValueError if it cannot be made (no segments for srt/vtt). A lone
    surrogate in the text (a ``\\udXXX`` escape in the JSON), which UTF-8 cannot hold, is
    written as U+FFFD."""
    if fmt == "txt":
        return _SURROGATE.sub("\ufffd", str(record.get("text", "")).strip() + "\n")
    segments = record.get("segments")
    if not isinstance(segments, list):
        raise ValueError("no segments in the record (transcribe with --timestamps, into a new -o or with --overwrite)")
    try:
        return _SURROGATE.sub("\ufffd", to_srt(segments) if fmt == "srt" else to_vtt(segments))
    except (TypeError, KeyError, AttributeError, ValueError, OverflowError):
        raise ValueError("malformed segments in the record (each needs a finite start and end)") from None


# ---- the command -----------------------------------------------------------------------------------


class ExportUsageError(Exception):
    """Exit status 2."""


def add_parser(sub: Any) -> None:
    """The ``export`` subcommand on the CLI's subparsers."""
    e = sub.add_parser("export", help="write SRT/VTT subtitles or text files, one per input, from a results JSONL",
                       description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("results", metavar="OUT.jsonl", help="results file written by `transcribe`")
    e.add_argument("--format", "-f", choices=FORMATS, default="srt", help="output format (default: %(default)s)")
    e.add_argument("-d", "--dir", required=True, help="folder for the files (created if missing)")
    e.add_argument("--overwrite", action="store_true", help="replace files that already exist")
    e.add_argument("-q", "--quiet", action="store_true", help="only errors on stderr")


def cmd_export(args: argparse.Namespace) -> int:
    """Write one file per transcribed input; see the module docstring for exit statuses."""
    from polyaccel.asr.results_file import (
        NotResultsFile,
        one_per_input,
        record_file,
        record_path,
        scan_results,
    )

    try:
        if not os.path.isfile(args.results):
            if os.path.exists(args.results):
                raise ExportUsageError(f"{args.results} is not a regular file (a folder, device or pipe); "
                                       "export reads the results file `transcribe` wrote")
            raise ExportUsageError(f"no such results file: {args.results}")
        try:
            records = scan_results(args.results).records
        except NotResultsFile as e:
            raise ExportUsageError(f"{args.results} is not a polyaccel-asr results file ({e})") from None
        except OSError as e:
            raise ExportUsageError(f"cannot read {args.results}: {e.strerror or e}") from None
        created = _missing_dirs(args.dir)
        out_dir = _out_dir(args.dir)
        leftovers = _killed_writes(out_dir)
        exported = _Exported()
    except ExportUsageError as e:
        _say(f"polyaccel-asr export: error: {e}")
        return EXIT_USAGE

    # one line per input: a resumed file's good line over its failed one; a failure said once
    written, same, problems, taken = 0, 0, 0, set()
    # --overwrite never replaces a recording (audio named talk.txt exports to talk.txt)
    inputs = {_file_id(os.fsencode(record_file(r))) for r in records} - {None} if args.overwrite else set()
    for rec in one_per_input(records):
        path = record_path(rec)
        shown = rec.get("path", path)
        if rec.get("error"):
            problems += 1
            _say(f"  skipped {shown}: it failed ({rec['error']})")
            continue
        try:
            body = render(rec, args.format)
        except ValueError as e:
            problems += 1
            _say(f"  skipped {shown}: {e}")
            continue
        target = _target(out_dir, path, args.format, taken)
        if _same_file(target, args.results):
            problems += 1
            _say(f"  skipped {shown}: {_show(target)} is the results file itself")
            continue
        if inputs and _file_id(target) in inputs:
            problems += 1
            _say(f"  skipped {shown}: {_show(target)} is an input that was transcribed; never replaced")
            continue
        if args.overwrite and not _holds_text(target):
            problems += 1
            _say(f"  skipped {shown}: {_show(target)} does not hold text (audio?); never replaced")
            continue
        data, aside = body.encode("utf-8"), None
        try:
            if args.overwrite and _kept_by_overwrite(target, data, exported):
                aside = _keep_aside(target)
            _write(target, body, args.overwrite)
        except FileExistsError:
            if _holds_exactly(target, data):  # a rerun: this very file is there
                same += 1
                exported.remember(target, data)
                _remove(leftovers.pop(os.path.basename(target), ()))
                continue
            problems += 1
            kept = "" if exported.wrote(target) else "; it keeps this file as <name>.bak-<time>"
            _say(f"  skipped {shown}: {_show(target)} exists with other content (--overwrite replaces it){kept}")
            continue
        except OSError as e:
            if aside is not None and os.path.lexists(target):  # not replaced: the file keeps its one name
                _remove([aside])
            problems += 1
            _say(f"  failed {shown}: cannot write {_show(target)}: {e.strerror or e}")
            continue
        written += 1
        exported.remember(target, data)
        if aside is not None:
            _say(f"  {shown}: {_show(target)} was not written by export (or was edited since): kept as "
                 f"{_show(os.path.basename(aside))}")
        _remove(leftovers.pop(os.path.basename(target), ()))
        if not args.quiet and os.path.basename(target) != _name(path, args.format):
            why = "name cut to fit" if len(_name(path, args.format)) > NAME_MAX else "name taken by another input"
            _say(f"  {shown} -> {_show(target)} ({why})")
    exported.save()
    if not written:
        for d in reversed(created):  # no empty folders left by a run that wrote nothing
            with contextlib.suppress(OSError):
                os.rmdir(d)
    if not args.quiet or problems:
        _say(f"{written} written to {args.dir}, " + (f"{same} already up to date, " if same else "") + f"{problems} not")
    if problems and not written and not same:
        return EXIT_NOTHING_DONE
    return EXIT_SOME_FAILED if problems else EXIT_OK


def _say(message: str) -> None:
    """One line on stderr, the paths it quotes escaped (a newline in a name cannot start a line)."""
    from polyaccel.asr.results_file import printable

    print(printable(message), file=sys.stderr)


def _show(name: bytes) -> str:
    """A file name for messages: odd bytes as ``\\xNN``, as in the records' ``path``."""
    return name.decode("utf-8", "backslashreplace")


def _out_dir(d: str) -> bytes:
    if os.path.lexists(d) and not os.path.isdir(d):
        raise ExportUsageError(f"-d {d} exists and is not a folder")
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise ExportUsageError(f"-d {d}: cannot create it ({e.strerror})") from None
    return os.fsencode(d)


def _name(path: str, fmt: str) -> bytes:
    """``stem.fmt`` of an input path, as bytes (exact for non-UTF-8 names)."""
    base = os.path.basename(os.fsencode(path)) or b"audio"
    stem = os.path.splitext(base)[0] if not base.startswith(b".") or base.count(b".") > 1 else base
    return stem + b"." + fmt.encode()


def _target(out_dir: bytes, path: str, fmt: str, taken: set[str]) -> bytes:
    """The file for ``path`` in ``out_dir``: its :func:`_name`, or ``stem-2.fmt``, ... when another
    input took that name in any letter case (``A.srt`` and ``a.srt`` are one file on macOS and
    Windows file systems)."""
    ext = b"." + fmt.encode()
    stem = _name(path, fmt)[: -len(ext)]
    name, k = _fit(stem, NAME_MAX - len(ext)) + ext, 1
    while _fold(name) in taken:
        k += 1
        name = _fit(stem, NAME_MAX - len(ext) - len(b"-%d" % k)) + b"-%d" % k + ext
    taken.add(_fold(name))
    return os.path.join(out_dir, name)


def _fit(stem: bytes, room: int) -> bytes:
    """``stem`` cut to ``room`` bytes (whole characters when it is UTF-8): an input named with
    the 255 bytes a file name may have, ``x.au``, has no room for ``.srt``."""
    if len(stem) <= room:
        return stem
    try:
        return os.fsencode(fit_name(stem.decode("utf-8"), room))
    except UnicodeDecodeError:
        return stem[:room]


def _fold(name: bytes) -> str:
    """A file name without letter case, for comparing names (odd bytes kept as they are)."""
    return os.fsdecode(name).casefold()


def _same_file(a: bytes, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _file_id(path: bytes) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def _missing_dirs(d: str) -> list[str]:
    """The folders of ``d`` that do not exist yet, outermost first."""
    missing = []
    path = os.path.abspath(d)
    while not os.path.lexists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing[::-1]


_TEMP = re.compile(rb"(.+\.(?:srt|vtt|txt))\.[0-9a-f]{12}\.tmp")


def _killed_writes(out_dir: bytes) -> dict[bytes, list[bytes]]:
    """The temporary files an export killed mid-write left in ``out_dir`` (``a.srt.<12 hex>.tmp``:
    regular files of ours, older than this run), by the name they were for. Each is removed
    once this run has that file (so only a name this run writes, never anything else)."""
    import time

    found: dict[bytes, list[bytes]] = {}
    now, uid = time.time(), os.getuid()
    try:
        names = os.listdir(out_dir)
    except OSError:
        return found
    for name in names:
        m = _TEMP.fullmatch(name)
        if not m:
            continue
        path = os.path.join(out_dir, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and st.st_mtime < now - 1:
                found.setdefault(m[1], []).append(path)
    return found


def _remove(paths: Sequence[bytes]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)


def _open_existing(path: bytes) -> int:
    """``path`` opened for reading, never through a link nor blocking on a FIFO (OSError)."""
    return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)


def _holds_exactly(path: bytes, data: bytes) -> bool:
    """Whether ``path`` is a regular file (not a link) holding exactly ``data``."""
    try:
        fd = _open_existing(path)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_size == len(data) and os.read(fd, len(data) + 1) == data
    finally:
        os.close(fd)


def _holds_text(path: bytes, probe: int = 1 << 16) -> bool:
    """Whether ``path`` is missing or a regular file whose first bytes are UTF-8 text with no NUL
    (what export writes), so that ``--overwrite`` may replace it."""
    import codecs

    try:
        fd = _open_existing(path)
    except FileNotFoundError:
        return True
    except OSError:
        return os.path.islink(path)  # a link is replaced, never written through; else: not ours
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, probe)
    finally:
        os.close(fd)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return b"\0" not in head


def _kept_by_overwrite(target: bytes, data: bytes, exported: _Exported) -> bool:
    """Whether ``--overwrite`` must keep the regular file at ``target`` before replacing it: its
    only name (a file with other hard links stays under those), not what this run writes, nor a
    file export wrote and nobody changed since."""
    try:
        st = os.lstat(target)
    except OSError:
        return False
    return (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and not _holds_exactly(target, data)
            and not exported.wrote(target))


def _keep_aside(target: bytes) -> bytes:
    """Give ``target``'s file a second name ``<name>.bak-<time>[-N]`` (a hard link, never over an
    existing file; a rename where there are none): the replace that follows keeps it. Returns it."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S").encode()
    for n in range(1, 1000):
        aside = target + b".bak-" + stamp + (b"-%d" % n if n > 1 else b"")
        try:
            os.link(target, aside)
            return aside
        except FileExistsError:
            continue
        except OSError:  # a file system without hard links
            if os.path.lexists(aside):
                continue
            os.rename(target, aside)
            return aside
    raise FileExistsError(errno.EEXIST, "no free name to keep the file under", os.fsdecode(target))


class _Exported:
    """The sha256 of each file export wrote, by real path, kept in ``exports_sha256.json`` in
    the cache root (``$POLYACCEL_CACHE``, else ``~/.cache/polyaccel``): a file holding what export
    wrote there is export's to replace. Unreadable or missing: every file counts as not export's
    (kept by ``--overwrite``, never lost)."""

    def __init__(self) -> None:
        from polyaccel.asr.weights import cache_dir

        try:
            self.path: str | None = os.path.join(cache_dir().parent, "exports_sha256.json")
        except RuntimeError:  # no home folder to find (a container user without one)
            self.path = None
        self.known = self._read()
        self.new: dict[str, str] = {}

    def _read(self) -> dict[str, str]:
        import json

        if self.path is None:
            return {}
        try:
            data = json.loads(read_regular(self.path, 64 << 20) or b"{}")
        except (ValueError, RecursionError):
            return {}
        return data if isinstance(data, dict) else {}

    def wrote(self, target: bytes) -> bool:
        """Whether ``target`` is a regular file holding what export last wrote there."""
        real = os.fsdecode(os.path.realpath(target))
        sha = self.new.get(real) or self.known.get(real)
        if not isinstance(sha, str) or not is_regular(target):
            return False
        try:
            with open(target, "rb") as f:
                return _sha256(f.read()) == sha
        except OSError:
            return False

    def remember(self, target: bytes, data: bytes) -> None:
        self.new[os.fsdecode(os.path.realpath(target))] = _sha256(data)

    def save(self) -> None:
        """Add this run's files to the index (under a lock, merged with what other runs added;
        entries of files gone are dropped). A cache that cannot be written only means that a
        later ``--overwrite`` keeps those files aside."""
        import fcntl
        import json

        if not self.new or self.path is None:
            return
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                merged = {k: v for k, v in {**self._read(), **self.new}.items() if os.path.lexists(k)}
                replace_file(self.path, json.dumps(merged).encode())
            finally:
                os.close(fd)


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _write(target: bytes, body: str, overwrite: bool) -> None:
    # Never a cut file in place (a rerun would take it for finished: "exists"), even after a kill.
    (replace_file if overwrite else create_file)(target, body.encode("utf-8"))
