"""A resume never mixes lines made with another ``--dtype``, ``--overlap`` or
``--no-speech-threshold`` into one results file: each line names them (``dtype``,
``overlap_s``, and ``no_speech_threshold`` when on), a resume that would differ is refused
(exit 2, the file byte for byte as it was), lines from before these fields resume. Fake
recognizers (fast, exact) except one tiny random ConformerAED, to see the dtype really loaded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr import cli
from polyaccel.asr.transcriber import Transcriber

SR = 16000


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """A fake model (its text: the sample count) built as from_pretrained would be with the
    settings asked for (dtype by default the CPU backend's float32); returns what each load
    was asked for."""
    asked: list[dict] = []

    def fake_from_pretrained(name: str = "fake", *, batch_size: int | None = None, replicas: int | None = None,
                             dtype=None, overlap_s: float = 3.0, no_speech_threshold: float | None = None, **kw):
        asked.append({"name": name, "dtype": dtype, "overlap_s": overlap_s, "no_speech_threshold": no_speech_threshold})
        tr = Transcriber(lambda i: (lambda batch: [f"{len(a)} samples" for a in batch]), sample_rate=SR,
                         max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                         overlap_s=overlap_s, model_name=name)
        tr.weights_sha256 = "ab" * 32
        tr.dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        tr.no_speech_threshold = no_speech_threshold
        return tr

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(fake_from_pretrained))
    from polyaccel.asr import weights  # what a rerun with nothing left to do checks the file against

    monkeypatch.setattr(weights, "model_provenance", lambda name, **kw: {"model": name, "weights_sha256": "ab" * 32})
    return asked


def _clips(asr_cli, tmp_path: Path, n: int = 2) -> list[str]:
    return [str(asr_cli.wav(tmp_path / f"{i}.wav")) for i in range(n)]


# ---- what each line says -------------------------------------------------------------------------------


def test_each_line_names_its_dtype_and_overlap_and_a_threshold_only_when_on(asr_cli, loads: list[dict],
                                                                            tmp_path: Path) -> None:
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, "-o", str(out)) == 0
    (rec,) = asr_cli.results(out)
    assert rec["dtype"] == "float32" and rec["overlap_s"] == 3.0 and "no_speech_threshold" not in rec
    other = tmp_path / "other.jsonl"
    assert asr_cli.run(a, "-o", str(other), "--dtype", "bfloat16", "--overlap", "1.5",
                       "--no-speech-threshold", "0.6") == 0
    (rec,) = asr_cli.results(other)
    assert (rec["dtype"], rec["overlap_s"], rec["no_speech_threshold"]) == ("bfloat16", 1.5, 0.6)


def test_a_resume_with_the_same_settings_goes_on(asr_cli, loads: list[dict], tmp_path: Path) -> None:
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    same = ("--dtype", "float16", "--overlap", "2", "--no-speech-threshold", "0.5")
    assert asr_cli.run(a, "-o", str(out), *same) == 0
    first = out.read_bytes()
    assert asr_cli.run(a, b, "-o", str(out), *same) == 0
    assert out.read_bytes().startswith(first)
    assert [(r["path"], r["dtype"], r["overlap_s"], r["no_speech_threshold"])
            for r in asr_cli.results(out)] == [(a, "float16", 2.0, 0.5), (b, "float16", 2.0, 0.5)]
    assert asr_cli.run(a, b, "-o", str(out), *same) == 0  # nothing left to do: no model loaded
    assert len(loads) == 2


def test_a_default_dtype_resumes_lines_made_with_that_dtype(asr_cli, loads: list[dict],
                                                           tmp_path: Path) -> None:
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, "-o", str(out), "--dtype", "float32") == 0
    assert asr_cli.run(a, b, "-o", str(out)) == 0  # the backend's float32: the same
    assert [r["dtype"] for r in asr_cli.results(out)] == ["float32", "float32"]


# ---- another setting: refused, the file untouched --------------------------------------------------------


DIFFERENT = [  # (first run's flags, this run's, how the message names the first's, and this run's)
    pytest.param(["--dtype", "bfloat16"], ["--dtype", "float16"], ("dtype bfloat16", "dtype float16"), id="dtype"),
    pytest.param([], ["--dtype", "bfloat16"], ("dtype float32", "dtype bfloat16"), id="default-dtype-then-bfloat16"),
    pytest.param(["--overlap", "3"], ["--overlap", "1"], ("overlap 3 s", "overlap 1 s"), id="overlap"),
    pytest.param([], ["--no-speech-threshold", "0.6"], ("no-speech threshold off", "no-speech threshold 0.6"),
                 id="threshold-on"),
    pytest.param(["--no-speech-threshold", "0.6"], [], ("no-speech threshold 0.6", "no-speech threshold off"),
                 id="threshold-off"),
    pytest.param(["--no-speech-threshold", "0.6"], ["--no-speech-threshold", "0.5"],
                 ("no-speech threshold 0.6", "no-speech threshold 0.5"), id="threshold-other"),
]


def _refused(err: str, named: tuple[str, str]) -> bool:
    """The usage error names the kept lines' setting, then this run's."""
    theirs, mine = named
    return ("holds results made another way" in err and f"no timestamps, {theirs}; this run: " in err
            and f"no timestamps, {mine}); resuming" in err)


@pytest.mark.parametrize(("before", "now", "named"), DIFFERENT)
def test_a_resume_with_another_setting_is_refused(asr_cli, loads: list[dict], tmp_path: Path,
                                                  before: list[str], now: list[str], named: tuple[str, str],
                                                  capsys: pytest.CaptureFixture) -> None:
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, "-o", str(out), *before) == 0
    content = out.read_bytes()
    capsys.readouterr()
    assert asr_cli.run(a, b, "-o", str(out), *now) == 2
    err = capsys.readouterr().err
    assert _refused(err, named), err
    assert out.read_bytes() == content, "untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.wav", "1.wav", "out.jsonl"]


@pytest.mark.parametrize(("before", "now", "named"), DIFFERENT)
def test_nothing_left_to_do_with_another_setting_is_refused_without_loading(asr_cli, loads: list[dict],
                                                                            tmp_path: Path,
                                                                            before: list[str], now: list[str],
                                                                            named: tuple[str, str],
                                                                            capsys: pytest.CaptureFixture) -> None:
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, b, "-o", str(out), *before) == 0
    content = out.read_bytes()
    capsys.readouterr()
    assert asr_cli.run(a, b, "-o", str(out), *now) == 2
    err = capsys.readouterr().err
    assert _refused(err, named) and "nothing to do" not in err, err
    assert out.read_bytes() == content and len(loads) == 1, "refused before any model loads"


def test_nothing_left_to_do_without_dtype_is_no_clash(asr_cli, loads: list[dict], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """Unset, --dtype means the backend's, which is not known without loading the model: not a clash."""
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, b, "-o", str(out), "--dtype", "bfloat16") == 0
    content = out.read_bytes()
    assert asr_cli.run(a, b, "-o", str(out)) == 0
    assert asr_cli.run(a, b, "-o", str(out), "--dtype", "bfloat16") == 0
    assert "made another way" not in capsys.readouterr().err
    assert out.read_bytes() == content and len(loads) == 1


# ---- lines from before these fields ------------------------------------------------------------------------


def _as_before_the_fields(asr_cli, out: Path) -> bytes:
    """Rewrite ``out`` as a run before lines named their dtype and overlap would have written it."""
    recs = asr_cli.results(out)
    for r in recs:
        for key in ("dtype", "overlap_s", "no_speech_threshold"):
            r.pop(key, None)
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return out.read_bytes()


@pytest.mark.parametrize("now", [[], ["--dtype", "bfloat16", "--overlap", "1", "--no-speech-threshold", "0.6"]])
def test_lines_from_before_the_fields_resume(asr_cli, loads: list[dict], tmp_path: Path,
                                             now: list[str]) -> None:
    a, b, c = _clips(asr_cli, tmp_path, 3)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, b, "-o", str(out)) == 0
    old = _as_before_the_fields(asr_cli, out)
    assert asr_cli.run(a, b, "-o", str(out), *now) == 0, "nothing left to do"
    assert out.read_bytes() == old
    assert asr_cli.run(a, b, c, "-o", str(out), *now) == 0
    assert out.read_bytes().startswith(old)
    assert [r["path"] for r in asr_cli.results(out)] == [a, b, c]


# ---- the Ray path writes the same fields -----------------------------------------------------------------


def test_ray_actor_lines_name_dtype_and_overlap(asr_cli, loads: list[dict], tmp_path: Path) -> None:
    from polyaccel.asr.ray_job import TranscribeActor

    wav = str(asr_cli.wav(tmp_path / "a.wav"))
    actor = TranscribeActor.__new__(TranscribeActor)  # as __init__ would build it, without Ray
    actor.model = "fake"
    actor.transcriber = Transcriber.from_pretrained("fake", dtype=None, overlap_s=1.5)
    try:
        batch = {"idx": np.asarray([0]), "path": np.asarray([os.fsencode(wav)], dtype=object),
                 "read_path": np.asarray([os.fsencode(wav)], dtype=object), "ref": np.asarray([None], dtype=object)}
        (line,) = actor(batch)["record"]
    finally:
        actor.transcriber.close()
    rec = json.loads(line)
    assert (rec["dtype"], rec["overlap_s"]) == ("float32", 1.5) and "no_speech_threshold" not in rec
    assert cli._made_differently([rec], rec, False) is None


# ---- a real (tiny) model: the dtype it was loaded in ------------------------------------------------------


def test_a_real_model_records_the_dtype_it_was_loaded_in(asr_cli, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    import torch

    from polyaccel.asr.conformer import ConformerAED
    from polyaccel.asr.conformer_config import tiny

    model = tmp_path / "tiny-conformer"
    ConformerAED.from_config(tiny(), seed=1).save_pretrained(model)
    a, b = str(asr_cli.wav(tmp_path / "a.wav", 0.5)), str(asr_cli.wav(tmp_path / "b.wav", 0.5))
    out = tmp_path / "out.jsonl"
    threads = torch.get_num_threads()
    try:
        common = ("-o", str(out), "--backend", "cpu", "--model", str(model))
        assert asr_cli.run(a, *common) == 0
        (rec,) = asr_cli.results(out)
        assert rec["dtype"] == str(torch.get_default_dtype()).removeprefix("torch.") == "float32"
        content = out.read_bytes()
        capsys.readouterr()
        assert asr_cli.run(a, b, *common, "--dtype", "bfloat16") == 2
        assert "dtype float32; this run: " in capsys.readouterr().err and out.read_bytes() == content
        assert asr_cli.run(a, b, *common, "--dtype", "float32") == 0
        assert [r["dtype"] for r in asr_cli.results(out)] == ["float32", "float32"]
    finally:
        torch.set_num_threads(threads)


def test_an_overlap_over_half_the_window_is_refused_not_recorded(asr_cli, loads: list[dict], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Windows overlap by at most half their length: --overlap 29 ran as 15 and its lines said
    29, so a rerun with 15 (what was used) was refused as made another way."""
    a, _ = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, "-o", str(out), "--overlap", "29") == 2
    assert "at most half the model's 30 s window (15 s), got 29" in capsys.readouterr().err
    assert not out.exists()
    assert asr_cli.run(a, "-o", str(out), "--overlap", "15") == 0
    assert asr_cli.results(out)[0]["overlap_s"] == 15.0


def test_overlaps_that_cut_the_same_windows_resume(asr_cli, loads: list[dict], tmp_path: Path) -> None:
    """3.0000001 s and 3 s are the same sample: the same windows, so a resume goes on."""
    a, b = _clips(asr_cli, tmp_path)
    out = tmp_path / "out.jsonl"
    assert asr_cli.run(a, "-o", str(out), "--overlap", "3") == 0
    assert asr_cli.run(a, b, "-o", str(out), "--overlap", "3.0000001") == 0
    assert [r["path"] for r in asr_cli.results(out)] == [a, b]
    assert asr_cli.run(a, b, "-o", str(out), "--overlap", "3.01") == 2  # another window: refused
