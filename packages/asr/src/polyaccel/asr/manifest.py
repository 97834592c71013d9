"""Inputs and outputs of a transcription job: which files to read, their reference texts, and
the resumable JSONL results file.

Inputs are audio files, directories (searched recursively for audio extensions) or NeMo-style
manifests (JSONL lines ``{"audio_filepath" | "path": ..., "text"?: ...}``). References come
from the manifest's ``text`` or a separate file (JSONL ``{"path" | "id", "text"}`` or the
Sphinx ``transcription`` format ``<s> text </s> (id)``).

The results file (reading, repairing, appending, locking) lives in
:mod:`polyaccel.asr.results_file`; ``ResultsWriter`` and ``load_results`` are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from polyaccel.asr.audio import AUDIO_EXTENSIONS
from polyaccel.asr.results_file import ResultsWriter, file_name_problem, load_results, path_key

__all__ = ["InputItem", "ResultsWriter", "attach_refs", "expand_inputs", "load_results", "read_manifest",
           "read_refs", "ref_finder"]

MANIFEST_EXTENSIONS = frozenset({".jsonl", ".json", ".manifest"})


@dataclasses.dataclass(slots=True)
class InputItem:
    """One thing to transcribe: a file path and, when known, its reference text."""

    path: str
    ref: str | None = None

    @property
    def id(self) -> str:
        """The file name without extension (how Sphinx/Kaldi reference files name utterances)."""
        return Path(self.path).stem


def expand_inputs(specs: Iterable[str | os.PathLike]) -> list[InputItem]:
    """Turn command-line inputs into items, in a stable order.

    A directory yields its audio files (recursive, sorted): every entry with an audio extension
    that is not a folder, so that the job reports those it cannot read (a broken symlink, a
    FIFO, a socket, a device) as per-file errors instead of skipping them silently; a ``.jsonl``
    file is read as a manifest (relative paths resolved against the manifest's folder); anything
    else is taken as an audio path, even if missing, so the job reports it as a per-file error.
    A path inside a folder that may not be entered (or too long a name) is taken as an audio path too. A file named twice
    (by any spelling: relative, absolute, through a symlinked folder) is kept once. A folder
    that cannot be listed (no permission) raises OSError instead of being skipped silently.
    """
    items: list[InputItem] = []
    seen: set[str] = set()
    for spec in specs:
        p = Path(spec)
        try:
            is_dir = p.is_dir()
            is_manifest = not is_dir and p.suffix.lower() in MANIFEST_EXTENSIONS and p.is_file()
        except OSError:  # inside a folder we may not enter, a name too long: an error of this input alone
            is_dir = is_manifest = False
        if is_dir:
            found = [InputItem(str(f)) for f in sorted(_files_under(p)) if f.suffix.lower() in AUDIO_EXTENSIONS]
        elif is_manifest:
            found = read_manifest(p)
        else:
            found = [InputItem(str(p))]
        for it in found:
            key = path_key(it.path)
            if key not in seen:
                seen.add(key)
                items.append(it)
    return items


def _files_under(folder: Path) -> Iterator[Path]:
    """Every entry under ``folder`` that is not a folder (symlinked folders are listed, not
    entered). Unlike ``Path.rglob``, which skips a folder it may not list without a word, an
    unreadable folder raises its OSError."""
    def fail(e: OSError) -> None:
        raise e

    for top, _dirs, files in os.walk(folder, onerror=fail):
        yield from (Path(top, f) for f in files)


def read_manifest(path: str | os.PathLike) -> list[InputItem]:
    """Read a NeMo-style JSONL manifest: ``{"audio_filepath" | "path": str, "text"?: str}``.
    One file given two different texts is a ``ValueError`` (which is the reference?), and so
    is a line with a non-zero ``offset`` (NeMo's part of a file: it would be scored whole)."""
    path = Path(path)
    items = []
    texts: dict[str, tuple[str, int]] = {}
    for lineno, line in enumerate(_text_lines(path), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            audio = rec.get("audio_filepath") or rec.get("path") or rec.get("audio")
        except (json.JSONDecodeError, AttributeError, RecursionError):  # nested too deeply for json
            raise ValueError(f"{path}:{lineno}: not a JSON object") from None
        if not audio:
            raise ValueError(f"{path}:{lineno}: no 'audio_filepath' or 'path' field")
        if not isinstance(audio, str):
            raise ValueError(f"{path}:{lineno}: the audio path must be a string, got {audio!r}")
        if problem := file_name_problem(audio):
            raise ValueError(f"{path}:{lineno}: the audio path {audio!r} {problem}")
        if rec.get("offset") not in (None, 0):
            raise ValueError(f"{path}:{lineno}: 'offset' {rec['offset']!r}: a line for part of a file is not "
                             "supported (the whole file would be transcribed and scored against that part's "
                             "text); cut the parts into files of their own")
        text = rec.get("text")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: 'text' must be a string, got {text!r}")
        audio_path = Path(audio)
        if not audio_path.is_absolute():
            audio_path = path.parent / audio_path
        if text is not None:
            key = path_key(str(audio_path))
            first = texts.setdefault(key, (text, lineno))
            if first[0] != text:
                raise ValueError(f"{path}:{lineno}: {audio!r} has another 'text' on line {first[1]}: "
                                 f"which one is the reference?")
        items.append(InputItem(str(audio_path), text))
    return items


def _text_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (a leading byte order mark dropped); a file that is not
    UTF-8 (audio or a Latin-1 file given by mistake) is a ``ValueError`` naming it and the line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as e:
        lineno = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None


_SPHINX_LINE = re.compile(r"^\s*(?:<s>)?\s*(?P<text>.*?)\s*(?:</s>)?\s*\((?P<id>[^()]+)\)\s*$")


def read_refs(path: str | os.PathLike) -> dict[str, str]:
    """Reference texts keyed by path and by id (file stem): JSONL ``{"path"|"audio_filepath"|
    "id", "text"}`` lines or Sphinx ``<s> text </s> (id)`` lines (detected per line). One path
    or id given two different texts is a ``ValueError`` (which is the reference?), as in a manifest."""
    refs: dict[str, str] = {}
    given: dict[str, tuple[str, int]] = {}

    def put(key: str, text: str, lineno: int) -> None:
        first = given.setdefault(key, (text, lineno))
        if first[0] != text:
            raise ValueError(f"{path}:{lineno}: {key!r} has another text on line {first[1]}: "
                             "which one is the reference?")
        refs[key] = text

    for lineno, line in enumerate(_text_lines(Path(path)), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                rec = json.loads(line)
            except RecursionError:
                raise ValueError(f"{path}:{lineno}: nested too deeply to be a reference") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            key = rec.get("path") or rec.get("audio_filepath") or rec.get("id")
            if key is None or "text" not in rec:
                raise ValueError(f"{path}:{lineno}: a reference needs 'path' or 'id' and 'text'")
            if not isinstance(rec["text"], str):
                raise ValueError(f"{path}:{lineno}: 'text' must be a string, got {rec['text']!r}")
            put(str(key), rec["text"], lineno)
            refs.setdefault(Path(str(key)).stem, rec["text"])
            continue
        m = _SPHINX_LINE.match(line)
        if not m:
            raise ValueError(f"{path}:{lineno}: expected JSONL or '<s> text </s> (id)'")
        put(m["id"].strip(), m["text"], lineno)
    return refs


def attach_refs(items: Sequence[InputItem], refs: dict[str, str]) -> None:
    """Fill ``item.ref`` from ``refs`` (matched as :func:`ref_finder` matches)."""
    find = ref_finder(refs)
    for it in items:
        ref = find(it.path)
        if ref is not None:
            it.ref = ref


def ref_finder(refs: dict[str, str]) -> Callable[[str], str | None]:
    """``find(path)``: the reference of the file at ``path``, matched by the path as written,
    then by the file it names (a relative reference path taken from the current folder, so
    ``/data/a/x.wav``, ``a/x.wav`` and ``./a/x.wav`` are one file), then by file stem. Without
    the second step an input spelled otherwise than its reference fell through to the stem,
    and ``b/x.wav`` silently got ``a/x.wav``'s text."""
    by_file: dict[str, str] = {}
    for key, text in refs.items():
        if file_name_problem(key) is None:
            by_file.setdefault(path_key(key), text)

    def find(path: str) -> str | None:
        for ref in (refs.get(path), by_file.get(path_key(path)), refs.get(Path(path).stem)):
            if ref is not None:
                return ref
        return None

    return find
