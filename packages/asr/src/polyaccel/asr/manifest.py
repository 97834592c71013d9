"""Inputs and outputs of a transcription job: which files to read, their reference texts, and
the resumable JSONL results file.

Inputs are audio files, directories (searched recursively for audio extensions) or NeMo-style
manifests (JSONL lines ``{"audio_filepath" | "path": ..., "text"?: ...}``). References come
from the manifest's ``text`` or a separate file (JSONL ``{"path" | "id", "text"}`` or the
Sphinx ``transcription`` format ``<s> text </s> (id)``).

The results file has one JSON object per input, written and flushed as results arrive. On a
rerun it is repaired (a half-written last line from a crash is dropped), lines for files that
failed are dropped so they are retried, and files already transcribed are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from polyaccel.asr.audio import AUDIO_EXTENSIONS

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

    A directory yields its audio files (recursive, sorted); a ``.jsonl`` file is read as a
    manifest (relative paths resolved against the manifest's folder); anything else is taken
    as an audio path, even if missing, so the job reports it as a per-file error. Duplicate
    paths are kept once.
    """
    items: list[InputItem] = []
    seen: set[str] = set()
    for spec in specs:
        p = Path(spec)
        if p.is_dir():
            found = [InputItem(str(f)) for f in sorted(p.rglob("*"))
                     if f.is_file() and f.suffix.lower() in AUDIO_EXTENSIONS]
        elif p.suffix.lower() in MANIFEST_EXTENSIONS and p.is_file():
            found = read_manifest(p)
        else:
            found = [InputItem(str(p))]
        for it in found:
            if it.path not in seen:
                seen.add(it.path)
                items.append(it)
    return items


def read_manifest(path: str | os.PathLike) -> list[InputItem]:
    """Read a NeMo-style JSONL manifest: ``{"audio_filepath" | "path": str, "text"?: str}``."""
    path = Path(path)
    items = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            audio = rec.get("audio_filepath") or rec.get("path") or rec.get("audio")
        except (json.JSONDecodeError, AttributeError):
            raise ValueError(f"{path}:{lineno}: not a JSON object") from None
        if not audio:
            raise ValueError(f"{path}:{lineno}: no 'audio_filepath' or 'path' field")
        audio_path = Path(audio)
        if not audio_path.is_absolute():
            audio_path = path.parent / audio_path
        items.append(InputItem(str(audio_path), rec.get("text")))
    return items


_SPHINX_LINE = re.compile(r"^\s*(?:<s>)?\s*(?P<text>.*?)\s*(?:</s>)?\s*\((?P<id>[^()]+)\)\s*$")


def read_refs(path: str | os.PathLike) -> dict[str, str]:
    """Reference texts keyed by path and by id (file stem): JSONL ``{"path"|"audio_filepath"|
    "id", "text"}`` lines or Sphinx ``<s> text </s> (id)`` lines (detected per line)."""
    refs: dict[str, str] = {}
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            rec = json.loads(line)
            key = rec.get("path") or rec.get("audio_filepath") or rec.get("id")
            if key is None or "text" not in rec:
                raise ValueError(f"{path}:{lineno}: a reference needs 'path' or 'id' and 'text'")
            refs[str(key)] = rec["text"]
            refs.setdefault(Path(str(key)).stem, rec["text"])
            continue
        m = _SPHINX_LINE.match(line)
        if not m:
            raise ValueError(f"{path}:{lineno}: expected JSONL or '<s> text </s> (id)'")
        refs[m["id"].strip()] = m["text"]
    return refs


def attach_refs(items: Sequence[InputItem], refs: dict[str, str]) -> None:
    """Fill ``item.ref`` from ``refs`` (matched by full path, then by file stem)."""
    for it in items:
        ref = refs.get(it.path, refs.get(it.id))
        if ref is not None:
            it.ref = ref


# ---- results file ----------------------------------------------------------------------------


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All well-formed result records in a JSONL results file (broken lines skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "path" in rec:
                out.append(rec)
    return out


class ResultsWriter:
    """Appends one JSON line per result to ``path`` and flushes it, so a crash loses at most
    the line being written.

    Opening with ``resume=True`` (the default) repairs an existing file: it keeps only
    well-formed records without an error (one per path), drops the rest (a torn last line,
    failed files, duplicates), and :attr:`done` holds the paths that need no new run.
    ``resume=False`` starts the file afresh.
    """

    def __init__(self, path: str | os.PathLike, resume: bool = True):
        self.path = Path(path)
        self.done: set[str] = set()
        if resume and self.path.exists():
            kept = []
            for rec in load_results(self.path):
                if not rec.get("error") and rec["path"] not in self.done:
                    self.done.add(rec["path"])
                    kept.append(rec)
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(_dumps(r) for r in kept)
            os.replace(tmp, self.path)
        elif self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] | None = open(self.path, "a" if resume else "w", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and flush it to the OS."""
        assert self._f is not None, "writer is closed"
        self._f.write(_dumps(record))
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"
