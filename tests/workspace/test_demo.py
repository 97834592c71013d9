"""tools/demo.py (`make demo`) as a user meets it, with Ray and the model stubbed out where the
test is about the demo's own logic: a bad --clips / --model / --cpus is one line and exit 2
before Ray starts, actors that cannot start are one line and exit 1, and a run prints each
clip, the WER and the RTFx lines."""

from __future__ import annotations

import pytest


@pytest.fixture
def demo(load_tool):
    return load_tool("demo")


@pytest.fixture
def clips(tmp_path):
    folder = tmp_path / "clips"
    folder.mkdir()
    for stem in ("a", "b"):
        (folder / f"{stem}.wav").write_bytes(b"RIFF")  # never read: the job is stubbed
    (folder / "transcription").write_text("<s> hello world </s> (a)\n<s> good night </s> (b)\n")
    return folder


@pytest.fixture
def no_ray(monkeypatch):
    """Starting the local Ray cluster fails the test (the error must come before it)."""
    import polyaccel.core.ray_local as ray_local

    def refuse(*a, **k):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(ray_local, "init_local", refuse)


@pytest.fixture
def stub_job(monkeypatch):
    """No Ray cluster, a model that resolves; ``stub_job(fn)`` sets what the job does."""
    import polyaccel.asr.ray_job as ray_job
    import polyaccel.asr.weights as weights
    import polyaccel.core.ray_local as ray_local

    monkeypatch.setattr(ray_local, "init_local", lambda *a, **k: None)
    monkeypatch.setattr(weights, "resolve", lambda name: name)

    def set_job(fn):
        monkeypatch.setattr(ray_job, "transcribe_with_ray", fn)

    return set_job


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("make, says", [
    (lambda tmp: tmp / "no_such_folder", "no such folder"),
    (lambda tmp: tmp, "no LibriVox clips there"),
])
def test_bad_clips_folder_is_one_line_and_exit_2(demo, tmp_path, capsys, no_ray, make, says):
    assert demo.main(["--clips", str(make(tmp_path))]) == 2
    assert says in one_line_error(capsys)


def test_mistyped_model_is_one_line_and_exit_2_before_ray(demo, clips, capsys, no_ray):
    assert demo.main(["--clips", str(clips), "--model", "whisper-tiny.eng"]) == 2
    assert "did you mean 'whisper-tiny.en'" in one_line_error(capsys)


def test_zero_cpus_is_a_usage_error(demo, capsys, no_ray):
    with pytest.raises(SystemExit) as e:
        demo.main(["--cpus", "0"])
    assert e.value.code == 2


def test_actors_that_cannot_start_are_one_line_and_exit_1(demo, clips, capsys, stub_job):
    from polyaccel.asr.ray_job import ActorsFailed

    def fail(items, opts):
        raise ActorsFailed("the Ray actors could not start: ModelNotInstalled: nope")
        yield

    stub_job(fail)
    assert demo.main(["--clips", str(clips)]) == 1
    assert "the Ray actors could not start" in one_line_error(capsys)


def test_a_run_prints_each_clip_the_wer_and_the_rtfx(demo, clips, capsys, stub_job):
    def transcribe(items, opts):
        assert opts.backend == "cpu" and opts.num_actors == 1
        for item, text in zip(items, ["Hello, world.", "Good night!"]):
            yield {"path": item.path, "text": text, "error": None, "duration_s": 2.0, "rtfx": 4.0}

    stub_job(transcribe)
    assert demo.main(["--clips", str(clips)]) == 0
    out = capsys.readouterr().out
    assert "a.wav  (2.0 s)" in out and "hyp: Good night!" in out and "ref: hello world" in out
    assert "WER 0.00% (0 errors / 4 words, normalized)" in out
    assert "RTFx 4.00 in the actor" in out and "RTFx" in out.splitlines()[-1]
