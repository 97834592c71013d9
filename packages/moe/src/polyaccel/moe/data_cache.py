"""The token cache of a data file: tokenized once, then memory-mapped by every process and resume.

A cache is a folder ``<root>/<key>/`` (``root``: ``<checkpoint.dir>/.data_cache``, see
:func:`polyaccel.moe.train.data_cache_dir`) holding the document stream of the file, as
:func:`polyaccel.moe.data.build_dataset` reads it, unpacked:

- ``tokens.bin``: every token id, documents one after the other (``uint16`` where the model's
  vocabulary fits, else ``uint32``);
- ``mask.bin``: one byte a token, 1 where it is a loss target;
- ``offsets.bin``: ``int64`` start of each document, and the end;
- ``meta.json``: :data:`MAGIC`, :data:`VERSION`, the key, the counts, the padding id, a CRC-32
  and the identity (``stat``) of each file, and the warnings reading the data gave (repeated
  when the cache is used).

The key hashes what decides the tokens: the data file's bytes (SHA-256 of all of them: at
~1.7 GB/s a few percent of the time reading even pre-tokenized data takes, and no edit is missed), its format and
``data.field``, the tokenizer's files and the Transformers/tokenizers versions, and the
model's vocabulary size (ids are checked against it). ``train.seq_len`` is not part of it:
packing happens when samples are read, so another ``seq_len`` maps the same cache.

The data file is hashed once, not at every start of every process: ``<root>/sources/<h>.json``
(``h``: SHA-256 of the file's absolute path) remembers its SHA-256 with its identity
``(st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns)``, and a process whose ``stat`` of the
file matches all five uses the recorded hash. The ctime makes this safe in practice: every
write to a file sets its ctime to the current time, and no call sets it back (``os.utime``
restoring the mtime itself sets the ctime), so an edit of the same size with its mtime restored
still differs; a file renamed over the data, or restored from a backup, is another inode. Two
limits are handled: a file changed within :data:`SETTLE_S` seconds of the start is hashed and
not remembered (a write in the same tick of the file system's clock could keep the same times),
and one that changes while it is hashed is not remembered either. A memo that is not readable,
not JSON or not for this path and identity is ignored and rewritten, never trusted. It keeps
the last :data:`MEMO_IDENTITIES` identities (other nodes may mount a shared file system under
another ``st_dev``). The first process to lock ``<h>.lock`` hashes; the others started with it
wait, then read its memo, or hash side by side where it left none they can use.

A cache is written in a fresh ``<key>.tmp-*`` folder, each file synced, ``meta.json`` last,
then renamed to ``<key>`` in one step: a kill leaves a ``.tmp-*`` folder, never a ``<key>``
that is used. A ``<key>`` whose ``meta.json`` is missing or wrong, or whose files have
another length or CRC, is rebuilt, never used. Under several processes the first to take
``<key>.lock`` (``flock``) builds; the others wait for it, then map its cache.

``meta.json`` also records each file's identity when it was built: a file whose ``stat`` still
matches (same inode, size, mtime and ctime: not written since) is not read through for its
CRC-32; any difference (a copy, an edit, a truncation, a restored mtime) reads it through.
:data:`VERIFY_ENV` ``=1`` rehashes the data file and reads every cache file through, whatever
is recorded (a disk suspected of corrupting data in place, which no ``stat`` shows).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import stat
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polyaccel.core.clitools import printable
from polyaccel.core.files import (
    fsync_dir,
    missing_dirs,
    read_regular,
    remove_empty_dirs,
    replace_file,
    sha256_of,
)

logger = logging.getLogger("polyaccel.moe")

MAGIC = "polyaccel-moe-token-cache"
VERSION = 1
FILES = ("tokens.bin", "mask.bin", "offsets.bin")
_CHUNK = 1 << 20  # tokens buffered before a write
_READ = 4 << 20  # bytes per read while hashing or checking
#: set to 1 to rehash the data file and read every cache file through at each start
VERIFY_ENV = "POLYACCEL_DATA_CACHE_VERIFY"
#: a data file changed less than this long before it is hashed is not remembered (see above)
SETTLE_S = 2.0
#: identities of the data file a memo keeps (one per node, where nodes see another ``st_dev``)
MEMO_IDENTITIES = 16
#: the largest ``meta.json`` read (its warnings included, it is a few KB)
META_LIMIT = 16 << 20


class CacheUnwritable(Exception):
    """The cache could not be written (a read-only folder, a full disk...): the data is then
    tokenized in memory. The message says where and why."""


@dataclass
class TokenCache:
    """A mapped cache: ``tokens`` and ``mask`` are read-only arrays over memory maps;
    ``vocab_size``: the model's, which every id read from ``tokens`` must be below."""

    folder: Path
    tokens: np.ndarray
    mask: np.ndarray
    documents: int
    pad_id: int
    has_target: bool
    vocab_size: int
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# The key
# --------------------------------------------------------------------------------------------

#: tokenizer files whose bytes decide the tokens (besides ``tokenizer*``)
_TOKENIZER_NAMES = frozenset({"vocab.json", "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                              "special_tokens_map.json", "added_tokens.json", "config.json"})


def key_material(data: Any, tokenizer_path: str | None, vocab_size: int) -> dict[str, Any]:
    """What decides the tokens of a data file read as ``data`` (a ``DataConfig``) describes,
    with the tokenizer in ``tokenizer_path``, for a model of ``vocab_size`` tokens, besides the
    file's bytes (:func:`cache_key` adds their hash)."""
    import tokenizers
    import transformers

    return {"magic": MAGIC, "version": VERSION, "kind": "jsonl" if data.jsonl else "text",
            "field": data.field if data.jsonl else None, "vocab_size": vocab_size,
            "tokenizer": _tokenizer_fingerprint(tokenizer_path),
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def cache_key(material: dict[str, Any], data_sha256: str) -> str:
    """The cache key of ``material`` (:func:`key_material`) for data of SHA-256 ``data_sha256``."""
    return hashlib.sha256(json.dumps(material | {"data": data_sha256}, sort_keys=True).encode()).hexdigest()[:32]


def file_sha256(path: Path) -> str:
    """SHA-256 of all of ``path``'s bytes, read in chunks."""
    with path.open("rb") as f:
        return _sha256_of(f)


def _sha256_of(f: Any) -> str:
    """SHA-256 of what is left to read in the binary file ``f`` (a seam the tests count reads at)."""
    return sha256_of(f, _READ)


def _tokenizer_fingerprint(folder: str | None) -> list[Any] | None:
    """Names and SHA-256 of the tokenizer files in ``folder`` (None without one; a file that
    cannot be read is named so: loading the tokenizer then says why)."""
    if folder is None or not Path(folder).is_dir():
        return None
    out = []
    for p in sorted(Path(folder).iterdir()):
        if (p.name.startswith("tokenizer") or p.name in _TOKENIZER_NAMES) and p.is_file():
            try:
                out.append([p.name, file_sha256(p)])
            except OSError as e:
                out.append([p.name, f"unreadable: {e.strerror or e}"])
    return out


# --------------------------------------------------------------------------------------------
# The data file's hash, remembered under its identity
# --------------------------------------------------------------------------------------------

def _verify_all() -> bool:
    return os.environ.get(VERIFY_ENV, "").strip() not in ("", "0")


def identity(st: os.stat_result) -> list[int]:
    """What tells a file from any edit of it or any file put in its place (module docstring)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def memo_paths(root: Path, source: Path) -> tuple[Path, Path]:
    """The memo of data file ``source``'s hash in ``root``, and the lock of hashing it."""
    name = hashlib.sha256(os.fsencode(os.path.abspath(source))).hexdigest()
    return root / "sources" / f"{name}.json", root / "sources" / f"{name}.lock"


def source_sha256(root: Path, source: Path) -> str:
    """SHA-256 of data file ``source``: the one its memo in ``root`` records for the file's
    current identity, else hashed and remembered where the file has settled. Of processes
    started together the first to lock hashes and the others then read its memo; where it
    left none they can use, they hash at once, side by side. Errors reading ``source``
    propagate; the memo is best effort (a read-only ``root`` only costs the hash)."""
    memo, lock_path = memo_paths(root, source)
    path = os.path.abspath(source)
    if _verify_all():  # every process hashes, as each would without a memo
        return _hash(source, memo, path)
    st = os.stat(source)
    if (known := _recalled(memo, path, st)) is not None:
        return known
    if not _settled(st):  # remembered by no one: hashing under the lock would only queue the processes
        return _hash(source, memo, path)
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock = _open_lock(lock_path)
    except OSError:
        return _hash(source, memo, path)
    with lock:
        waited = _lock(lock, f"waiting for another process to hash {source}", required=False)
        if (known := _recalled(memo, path, os.stat(source))) is not None:
            return known
        if not waited:  # the first: the others wait for its memo
            return _hash(source, memo, path)
    # the one waited for left no memo for this identity (the file changed, a full disk, another
    # node's st_dev): hashing under the lock would queue the processes one behind the other
    return _hash(source, memo, path)


def _open_lock(path: Path) -> Any:
    """``path`` opened for appending (created 0600 if missing) as a lock file; a symbolic link
    there is refused (OSError), never followed to create or open a file elsewhere, and so is a
    FIFO (which would block the open until a reader came)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    return os.fdopen(fd, "ab")


def _settled(st: os.stat_result) -> bool:
    """Whether the file of ``st`` was last changed long enough ago that a write now would
    give it another ctime (a write within the clock's tick of the last could keep it)."""
    return st.st_ctime_ns <= time.time_ns() - int(SETTLE_S * 1e9)


def _recalled(memo: Path, path: str, st: os.stat_result) -> str | None:
    """The hash ``memo`` records for file ``path`` of stat ``st``, or None where it records
    none for them (missing, unreadable, not JSON, another path or identity)."""
    want = identity(st)
    return next((digest for seen, digest in _memo_entries(memo, path) if seen == want), None)


def _memo_entries(memo: Path, path: str) -> list[list[Any]]:
    """The well-formed ``[identity, sha256]`` pairs ``memo`` holds for ``path`` (none where it
    is missing, unreadable, not JSON or for another path)."""
    raw = read_regular(memo, 1 << 16)
    if raw is None:
        return []
    try:
        entry = json.loads(raw)
    except (ValueError, RecursionError):
        return []
    if not isinstance(entry, dict) or entry.get("path") != path or not isinstance(entry.get("seen"), list):
        return []
    return [pair for pair in entry["seen"] if _well_formed(pair)]


def _well_formed(pair: Any) -> bool:
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], list) and isinstance(pair[1], str)):
        return False
    seen, digest = pair
    return (len(seen) == 5 and all(type(v) is int for v in seen)
            and len(digest) == 64 and not digest.strip("0123456789abcdef"))


def _hash(source: Path, memo: Path, path: str) -> str:
    """SHA-256 of ``source``, remembered in ``memo`` when the file has settled and did not
    change while it was read."""
    with source.open("rb") as f:
        before = os.fstat(f.fileno())
        digest = _sha256_of(f)
        after = os.fstat(f.fileno())
    if identity(before) == identity(after) and _settled(before):
        try:
            _remember(memo, path, identity(before), digest)
        except OSError as e:
            logger.debug("polyaccel.moe: cannot remember the hash of %s in %s (%s)", source, memo, e)
    return digest


def _remember(memo: Path, path: str, seen: list[int], digest: str) -> None:
    """Add ``seen`` -> ``digest`` to ``memo``, replacing older states of the same inode and
    keeping the last :data:`MEMO_IDENTITIES` (one per node where each mounts the data's file
    system under its own ``st_dev``)."""
    kept = [pair for pair in _memo_entries(memo, path) if pair[0][:2] != seen[:2]]
    entry = {"path": path, "seen": [*kept[max(0, len(kept) - MEMO_IDENTITIES + 1):], [seen, digest]]}
    memo.parent.mkdir(parents=True, exist_ok=True)
    replace_file(memo, json.dumps(entry).encode())


# --------------------------------------------------------------------------------------------
# Opening: map, or build under the lock and map
# --------------------------------------------------------------------------------------------

Documents = Callable[..., Iterator[tuple[list[int], list[bool]]]]


def open_cache(root: Path, material: dict[str, Any], documents: Documents, *, source: Path, vocab_size: int,
               pad_id: Callable[[], int], check: Callable[[int, bool], None]) -> TokenCache:
    """The cache in ``root`` of data file ``source`` and key ``material`` (:func:`key_material`),
    mapped; built first from ``documents(progress, notes)`` when missing or damaged (by the
    first process to lock it; the others wait, then map). ``pad_id()`` is asked once the
    documents are read; ``check(tokens, has_target)`` refuses data (raises) before a new cache is
    kept. Errors reading the data propagate; failing to write the cache is
    :class:`CacheUnwritable`. Neither leaves any folder it created."""
    made = missing_dirs(root / "sources")
    key = None
    try:
        key = cache_key(material, source_sha256(root, source))
        return _open(root, key, documents, source=source, vocab_size=vocab_size, pad_id=pad_id, check=check)
    except BaseException:
        if made:  # a refused or interrupted first build: leave no folder it created
            names = [*memo_paths(root, source), *([root / f"{key}.lock"] if key else [])]
            for name in names:
                with contextlib.suppress(OSError):
                    name.unlink()
            remove_empty_dirs(made)
        raise


def _open(root: Path, key: str, documents: Documents, *, source: Path, vocab_size: int,
          pad_id: Callable[[], int], check: Callable[[int, bool], None]) -> TokenCache:
    """:func:`open_cache` once the key is known."""
    verify = _verify_all()
    found = _hit(root / key, key, vocab_size, warn=False, verify=verify)  # no lock needed to read a cache (nor a writable folder)
    if found is not None:
        return _use(found, check)
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = _open_lock(root / f"{key}.lock")
    except OSError as e:
        raise CacheUnwritable(f"cannot write {root} ({e.strerror or e})") from None
    with lock:
        _lock(lock, f"waiting for another process to build the data cache {root / key}")
        found = _hit(root / key, key, vocab_size, warn=True, verify=verify)
        if found is None:
            return _build(root, key, documents, source=source, vocab_size=vocab_size, pad_id=pad_id, check=check)
        return _use(found, check)


def _use(found: TokenCache, check: Callable[[int, bool], None]) -> TokenCache:
    """``found``, checked, after repeating the warnings reading its data gave."""
    check(len(found.tokens), found.has_target)
    for note in found.notes:
        logger.warning("polyaccel.moe: %s", printable(note))  # meta.json is not checksummed
    return found


def _lock(lock: Any, waiting: str, *, required: bool = True) -> bool:
    """Take ``lock`` (``flock``), logging ``waiting`` when another process holds it; whether it
    had to wait. Where the file system refuses locks: an OSError if ``required``, else False
    (no lock)."""
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("polyaccel.moe: %s", waiting)
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            return True
    except OSError:
        if required:
            raise
    return False


def _hit(folder: Path, key: str, vocab_size: int, *, warn: bool, verify: bool = False) -> TokenCache | None:
    """The cache in ``folder``, or None where there is none or it is damaged (said if ``warn``)."""
    try:
        return load(folder, key, vocab_size, verify=verify)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        if warn:
            logger.warning("polyaccel.moe: data cache %s is not usable (%s); rebuilding it", folder, e)
        return None


def load(folder: Path, key: str, vocab_size: int, *, verify: bool = False) -> TokenCache:
    """Map the cache in ``folder`` for a model of ``vocab_size`` tokens after checking it:
    FileNotFoundError where there is none, ValueError (what is wrong) where its metadata, a
    file's length or a CRC is not right (the ids themselves are checked as samples are cut). A
    file's CRC is checked where its ``stat`` is not the one recorded when it was built, or
    where ``verify``."""
    try:
        meta = json.loads(_read_meta(folder))
    except UnicodeDecodeError as e:
        raise ValueError(f"meta.json is not text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"meta.json is not JSON ({e.msg})") from None
    _check_meta(meta, key, vocab_size)
    dtype = np.dtype(meta["dtype"])
    n, docs = meta["tokens"], meta["documents"]
    built = meta.get("stat") if isinstance(meta.get("stat"), dict) and not verify else {}
    with contextlib.ExitStack() as files:
        opened = []
        for name, size in zip(FILES, (n * dtype.itemsize, n, (docs + 1) * 8), strict=True):
            f = files.enter_context(_open_regular(folder / name))
            _check_file(f, name, size, meta["crc32"][name], built.get(name))
            opened.append(f)
        tokens, mask = _map(opened[0], dtype, n), _map(opened[1], np.dtype(np.uint8), n)
    return TokenCache(folder, tokens, mask, docs, meta["pad_id"], meta["has_target"], vocab_size,
                      list(meta["notes"]))


def _read_meta(folder: Path) -> bytes:
    """The bytes of ``folder/meta.json``: FileNotFoundError where ``folder`` is missing,
    ValueError where the file is missing, not a regular file (a FIFO, a link) or too large."""
    raw = read_regular(folder / "meta.json", META_LIMIT)
    if raw is not None:
        return raw
    if not os.path.lexists(folder):
        raise FileNotFoundError(folder)
    if not os.path.lexists(folder / "meta.json"):
        raise ValueError("it has no meta.json")
    raise ValueError(f"meta.json is not a regular file of at most {META_LIMIT} bytes")


def _open_regular(path: Path) -> Any:
    """``path`` opened for binary reading where it is a regular file (a link is not followed,
    a FIFO never blocks), else ValueError."""
    f = open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK | os.O_NOFOLLOW))  # noqa: SIM115
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise ValueError(f"{path.name} is not a regular file")
    return f


def _map(f: Any, dtype: np.dtype, n: int) -> np.ndarray:
    """The open file ``f`` as a read-only array of ``n`` items, mapped for random access: samples are
    drawn shuffled, and the kernel's read-ahead around each would map pages no sample needs."""
    if not n:
        return np.zeros(0, dtype)
    mm = mmap.mmap(f.fileno(), n * dtype.itemsize, access=mmap.ACCESS_READ)
    with contextlib.suppress(AttributeError, OSError):  # advice only
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=n)


def _check_meta(meta: Any, key: str, vocab_size: int) -> None:
    """A ValueError naming the first field of ``meta`` that is missing or wrong."""
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        raise ValueError("meta.json is not a token cache's")
    if meta.get("version") != VERSION:
        raise ValueError(f"version {meta.get('version')!r}, this polyaccel reads {VERSION}")
    if meta.get("key") != key:
        raise ValueError(f"key {meta.get('key')!r} is not its folder's")
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"dtype {meta.get('dtype')!r}")
    for name in ("tokens", "documents", "pad_id"):
        if not isinstance(meta.get(name), int) or isinstance(meta[name], bool) or meta[name] < 0:
            raise ValueError(f"{name} {meta.get(name)!r}")
    if meta["pad_id"] >= vocab_size:
        raise ValueError(f"pad_id {meta['pad_id']} is outside the vocabulary [0, {vocab_size})")
    notes = meta.get("notes")
    if not isinstance(meta.get("has_target"), bool) or not (isinstance(notes, list)
                                                            and all(isinstance(n, str) for n in notes)):
        raise ValueError("has_target or notes missing")
    crc = meta.get("crc32")
    if not isinstance(crc, dict) or any(not isinstance(crc.get(n), int) for n in FILES):
        raise ValueError("crc32 missing")


def _check_file(f: Any, name: str, size: int, crc: int, built: Any) -> None:
    """A ValueError where the open file ``f`` (``name``) is not ``size`` bytes of CRC-32
    ``crc``; its bytes are read for the CRC only where its ``stat`` is not ``built`` (the
    identity recorded when it was written: a file not written since has the CRC it had)."""
    st = os.fstat(f.fileno())
    if st.st_size != size:
        raise ValueError(f"{name} is {st.st_size} bytes, its metadata says {size}")
    if built == identity(st):
        return
    if file_crc32(f) != crc:
        raise ValueError(f"{name} does not match its CRC-32")


def file_crc32(f: Any) -> int:
    """CRC-32 of what is left to read in the binary file ``f``."""
    value = 0
    while chunk := f.read(_READ):
        value = zlib.crc32(chunk, value)
    return value


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------

def _build(root: Path, key: str, documents: Documents, *, source: Path, vocab_size: int,
           pad_id: Callable[[], int], check: Callable[[int, bool], None]) -> TokenCache:
    """Tokenize into ``root/<key>.tmp-*``, ``check`` it, then rename it to ``root/<key>``
    (replacing a damaged one) and map it."""
    _remove_leftovers(root, key)
    with _unwritable(root):
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.tmp-", dir=root))
    try:
        notes: list[str] = []
        with _unwritable(root):
            writer = _Writer(tmp, np.uint16 if vocab_size <= 2**16 else np.uint32)
        with writer, _progress(source) as bar:
            for ids, mask in documents(bar.update, notes):  # an error reading the data is the caller's
                with _unwritable(root):
                    writer.add(ids, mask)
        meta = {"magic": MAGIC, "version": VERSION, "key": key, "dtype": writer.dtype.name,
                "tokens": writer.tokens, "documents": writer.documents, "pad_id": pad_id(),
                "has_target": writer.has_target, "crc32": writer.crc, "notes": notes}
        check(writer.tokens, writer.has_target)
        with _unwritable(root):
            meta["stat"] = {name: identity(os.stat(tmp / name)) for name in FILES}
            _publish(tmp, root / key, json.dumps(meta).encode())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        return load(root / key, key, vocab_size, verify=True)
    except (OSError, ValueError) as e:
        raise CacheUnwritable(f"the cache just written to {root / key} does not read back ({e})") from None


@contextlib.contextmanager
def _unwritable(root: Path):
    """An OSError inside becomes :class:`CacheUnwritable` naming ``root``."""
    try:
        yield
    except OSError as e:
        raise CacheUnwritable(f"cannot write {root} ({e.strerror or e})") from None


def _remove_leftovers(root: Path, key: str) -> None:
    """Remove the ``<key>.tmp-*`` folders of builds a kill cut off (this process holds the lock)."""
    for p in root.glob(f"{key}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, final: Path, meta: bytes) -> None:
    """Write ``meta.json`` last, sync, and rename ``tmp`` to ``final`` (a damaged ``final``
    first moved aside and removed)."""
    with (tmp / "meta.json").open("wb") as f:
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists() or final.is_symlink():
        aside = Path(tempfile.mkdtemp(prefix=f"{final.name}.damaged-", dir=final.parent))
        os.rename(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(final.parent)


class _Writer:
    """Appends documents to the cache files in ``folder`` in chunks, with their CRC-32s."""

    def __init__(self, folder: Path, dtype: Any):
        self.dtype, self.folder = np.dtype(dtype), folder
        self.files = {name: (folder / name).open("wb") for name in FILES}
        self.crc = dict.fromkeys(FILES, 0)
        self.tokens = self.documents = 0
        self.has_target = False
        self._ids: list[np.ndarray] = []
        self._mask: list[np.ndarray] = []
        self._offsets: list[int] = [0]
        self._pending = 0

    def add(self, ids: list[int], mask: list[bool]) -> None:
        """Append one document (its ids are in the vocabulary, checked by the reader)."""
        a, m = np.asarray(ids, dtype=self.dtype), np.asarray(mask, dtype=np.uint8)
        # the stream's very first token is never a target (the model shifts labels)
        self.has_target = self.has_target or bool(m[1 if self.tokens == 0 else 0:].any())
        self._ids.append(a)
        self._mask.append(m)
        self.tokens += len(a)
        self.documents += 1
        self._offsets.append(self.tokens)
        self._pending += len(a)
        if self._pending >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if self._ids:
            self._write("tokens.bin", np.concatenate(self._ids))
            self._write("mask.bin", np.concatenate(self._mask))
        self._write("offsets.bin", np.asarray(self._offsets, dtype=np.int64))
        self._ids, self._mask, self._offsets, self._pending = [], [], [], 0

    def _write(self, name: str, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self.files[name].write(data)
        self.crc[name] = zlib.crc32(data, self.crc[name])

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, kind, *_) -> None:
        try:
            if kind is None:
                with _unwritable(self.folder.parent):
                    self._flush()
                    for f in self.files.values():
                        f.flush()
                        os.fsync(f.fileno())
        finally:
            for f in self.files.values():
                with contextlib.suppress(OSError):  # a buffered write that fails again on close
                    f.close()


@contextlib.contextmanager
def _progress(source: Path):
    """A byte-count bar on stderr for reading ``source``, shown once it takes over a second."""
    from tqdm.auto import tqdm

    try:
        total = source.stat().st_size
    except OSError:
        total = None
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {source.name}", delay=1.0,
              file=sys.stderr, dynamic_ncols=True) as bar:
        yield bar
