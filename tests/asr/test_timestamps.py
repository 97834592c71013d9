"""Whisper segment timestamps: our graph-capturable timestamp rules equal Hugging Face's
``WhisperTimeStampLogitsProcessor`` step by step; segments on real speech (tiny.en, base) equal
``generate(return_timestamps=True)``'s; a long file gets monotonic absolute times covering its
speech; SRT/VTT/txt export (golden files, names, overwrite, exit codes). Negative controls show
the comparisons catch a broken rule."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from polyaccel.asr import samples, weights
from polyaccel.asr.decoding import GreedyBuffers, Segment, TimestampRules, greedy_update
from polyaccel.asr.export import to_srt, to_vtt
from polyaccel.asr.timestamps import TimedText, stitch_segments

LIBRIVOX = samples.librivox_dir() or samples.DEBIAN_LIBRIVOX
SR = 16000

# A small vocabulary laid out like Whisper's: text < EOS <= specials < NO_TS < timestamps.
V, EOS, NO_TS = 120, 50, 59
BEGIN = NO_TS + 1


# ---- the rules against Hugging Face's processor -------------------------------------------------


def _hf_processor(max_initial: int | None = 5, detect: bool = True):
    from transformers import GenerationConfig
    from transformers.generation.logits_process import WhisperTimeStampLogitsProcessor

    cfg = GenerationConfig(eos_token_id=EOS, no_timestamps_token_id=NO_TS, max_initial_timestamp_index=max_initial)
    return WhisperTimeStampLogitsProcessor(cfg, begin_index=2, _detect_timestamp_from_logprob=detect)


def _run_both(ours: TimestampRules, hf, seed: int, steps: int = 40, B: int = 6) -> tuple[int, int]:
    """Greedy over random logits (timestamps made likely), ours through greedy_update's buffers,
    HF's on the whole id history. Returns (steps where the processed scores differ, steps)."""
    g = torch.Generator().manual_seed(seed)
    buf = GreedyBuffers.allocate(B, steps, "cpu")
    buf.reset(B, EOS)
    ids = torch.full((B, 2), 7, dtype=torch.int64)  # a 2-token prompt: begin_index 2
    differ = 0
    for _ in range(steps):
        logits = torch.randn(B, V, generator=g) * 3
        logits[:, BEGIN:] += torch.randn(B, 1, generator=g) * 3  # some rows favour timestamps
        logits[:, EOS] -= 6  # long sequences
        expected = hf(ids, logits.clone())
        got = ours.apply(logits.clone(), buf.out, buf.step)
        differ += int(not torch.equal(got, expected))
        nxt = expected.argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], 1)
        buf.out[:, int(buf.step)] = nxt
        buf.step += 1
    return differ, steps


@pytest.mark.parametrize("seed", range(8))
def test_rules_equal_transformers_processor_step_by_step(seed):
    differ, steps = _run_both(TimestampRules(BEGIN, NO_TS, EOS, 5), _hf_processor(5), seed)
    assert differ == 0, f"{differ} of {steps} steps differ"


def test_negative_controls_a_changed_rule_is_seen():
    """Each rule matters to the comparison above: change one on either side and it fails."""
    assert _run_both(TimestampRules(BEGIN, NO_TS, EOS, 5), _hf_processor(5, detect=False), 0)[0] > 0
    assert _run_both(TimestampRules(BEGIN, NO_TS, EOS, None), _hf_processor(5), 0)[0] > 0
    assert _run_both(TimestampRules(BEGIN, NO_TS, EOS + 1, 5), _hf_processor(5), 0)[0] > 0  # eos as text
    assert sum(_run_both(TimestampRules(BEGIN, NO_TS - 1, EOS, 5), _hf_processor(5), s)[0] for s in range(4)) > 0


def test_rules_inside_greedy_update_trace_as_one_graph():
    """The greedy step with the rules traces as one graph (TorchDynamo, fullgraph=True): no
    .item()/.tolist()/data-dependent branch or shape, which a CUDA graph capture also needs."""
    rules = TimestampRules(BEGIN, NO_TS, EOS, 5)
    buf = GreedyBuffers.allocate(4, 8, "cpu")
    buf.reset(3, EOS)
    bias = torch.zeros(V)

    def step(logits, *tensors):
        greedy_update(logits, bias, GreedyBuffers(*tensors), EOS, rules)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    for _ in range(8):
        compiled(torch.randn(4, V), *buf.tensors())
    out = buf.out[:3].tolist()
    assert all(row[0] >= BEGIN for row in out)  # first token a timestamp


class _NoHostData(torch.utils._python_dispatch.TorchDispatchMode):
    """Refuses what a CUDA graph capture refuses but a trace does not see: tensors made from
    host data (``torch.tensor(x, device=...)`` is a pageable host-to-device copy) and reads
    back to the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        to_other_device = name == "_to_copy" and kwargs.get("device") not in (None, args[0].device)
        if name in ("lift_fresh", "lift_fresh_copy", "_local_scalar_dense", "nonzero") or to_other_device:
            raise AssertionError(f"{name}: not capturable in a CUDA graph")
        return func(*args, **kwargs)


def test_rules_make_no_tensor_from_host_data():
    """The H200 run of ``transcribe --timestamps`` failed every batch: the rules built their
    ``-inf`` with ``torch.tensor(...)`` on the device, a host copy a CUDA graph capture refuses.
    Run the greedy step with the rules under a mode that refuses such ops."""
    rules = TimestampRules(BEGIN, NO_TS, EOS, 5)
    buf = GreedyBuffers.allocate(4, 8, "cpu")
    buf.reset(3, EOS)
    logits, bias = torch.randn(4, V), torch.zeros(V)
    with _NoHostData():
        for _ in range(3):
            greedy_update(logits, bias, buf, EOS, rules)


def test_segments_cut_like_transformers():
    r = TimestampRules(BEGIN, NO_TS, EOS, 50)

    def dec(ids):
        return " ".join(f"w{i}" for i in ids)

    t = BEGIN
    # pairs, then a final lone timestamp
    assert r.segments([t, 1, 2, t + 50, t + 50, 3, t + 90], dec, 30.0) == [
        Segment(0.0, 1.0, "w1 w2"), Segment(1.0, 1.8, "w3")]
    # text cut off after the last pair: kept, ending at the window's end
    assert r.segments([t, 1, t + 10, t + 10, 4, 5], dec, 12.5) == [Segment(0.0, 0.2, "w1"), Segment(0.2, 12.5, "w4 w5")]
    # no pair: one segment to the last timestamp, or to the window's end
    assert r.segments([t + 5, 1, 2, t + 100], dec, 30.0) == [Segment(0.0, 2.0, "w1 w2")]
    assert r.segments([t, 1, 2], dec, 7.5) == [Segment(0.0, 7.5, "w1 w2")]
    assert r.segments([], dec, 3.0) == []


def test_stitched_segments_are_absolute_and_monotonic():
    a = [Segment(0.0, 10.0, "one"), Segment(10.0, 25.0, "two"), Segment(25.0, 29.5, "cut")]
    b = [Segment(0.0, 2.0, "cut again"), Segment(2.5, 20.0, "three")]
    got = stitch_segments([a, b], [(0.0, 30.0), (27.0, 57.0)])  # seam at 28.5
    assert [s.text for s in got] == ["one", "two", "cut", "three"]
    assert got[-1] == Segment(29.5, 47.0, "three")
    assert stitch_segments([a, None], [(0.0, 30.0), (27.0, 57.0)]) is None
    assert TimedText("x", a).segments == a and str(TimedText("x", a)) == "x"



def _union_gaps(segs: list[Segment], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] that no segment covers."""
    covered, reach = 0.0, lo
    for s in sorted(segs, key=lambda s: s.start):
        a, b = max(s.start, reach), min(s.end, hi)
        if b > a:
            covered, reach = covered + b - a, b
    return hi - lo - covered


def test_stitched_segments_keep_speech_that_the_two_windows_cut_at_different_places():
    """Window 0 cuts at 15.78 s, window 1 at 12.79 and 18.75 s, around a seam at 15.915 s: the
    middle-of-the-segment rule dropped both windows' segments there (3 s of speech in no
    segment); the stitch keeps it, once."""
    w0 = [Segment(0.0, 5.0, "a"), Segment(5.0, 12.0, "b"), Segment(12.0, 15.78, "c"),
          Segment(15.78, 20.5, "d"), Segment(20.5, 26.0, "e"), Segment(26.0, 30.0, "f")]
    w1 = [Segment(s - 1.83, e - 1.83, t) for s, e, t in
          [(1.83, 6.0, "A"), (6.0, 12.79, "B"), (12.79, 18.75, "CD"), (18.75, 26.0, "E"), (26.0, 31.83, "FG")]]
    got = stitch_segments([w0, w1], [(0.0, 30.0), (1.83, 31.83)])
    assert _union_gaps(got, 0.0, 31.83) < 1e-6
    assert [s.text for s in got] == ["a", "b", "c", "d", "e", "FG"]
    assert all(x.end <= y.start for x, y in zip(got, got[1:]))


@pytest.mark.parametrize("seed", range(20))
def test_stitched_segments_cover_all_speech_however_windows_cut_it(seed):
    """Speech everywhere in a 100 s file; 30 s windows 5-25 s apart, each cutting its audio into
    segments at its own random places: the stitched segments leave out no more than a pause of
    it and never go back."""
    rng = np.random.default_rng(seed)
    total, spans, a = 100.0, [], 0.0
    while True:
        b = min(a + 30.0, total)
        spans.append((a, b))
        if b >= total:
            break
        a = b - float(rng.uniform(5.0, 25.0))
    windows = []
    for a, b in spans:
        cuts = np.sort(rng.uniform(a, b, size=int(rng.integers(0, 8))))
        edges = [a, *cuts.tolist(), b]
        windows.append([Segment(x - a, y - a, f"{x:.2f}") for x, y in zip(edges, edges[1:]) if y > x])
    got = stitch_segments(windows, spans)
    assert all(s.start <= s.end for s in got) and all(x.end <= y.start for x, y in zip(got, got[1:]))
    # Left out: at most a pause-long stretch, where covering it would repeat 10x as much (the
    # largest in 2,000 seeds: 0.81 s; the 99th percentile 0.26 s).
    assert got[0].start == 0.0 and got[-1].end == total
    assert max(y.start - x.end for x, y in zip(got, got[1:])) < 1.0
    assert _union_gaps(got, 0.0, total) < 1.0

# ---- real speech -----------------------------------------------------------------------------------


def _clips() -> list[np.ndarray]:
    import soundfile as sf

    files = sorted(LIBRIVOX.glob("*.wav"))
    if not files:
        pytest.skip("LibriVox clips missing (make setup)")
    return [sf.read(f, dtype="float32")[0] for f in files]


def _hf_segments(path: Path, audio: list[np.ndarray], hf_whisper=None,
                 **kw) -> list[list[tuple[float, float, str]]]:
    """Transformers' segments (``hf_whisper``: the session's loaded model, else loaded here)."""
    import transformers

    if hf_whisper is not None:
        proc, model = hf_whisper(path)
    else:
        proc = transformers.WhisperProcessor.from_pretrained(path)
        model = transformers.WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    feats = proc(audio, sampling_rate=SR, return_tensors="pt").input_features
    with torch.inference_mode():
        out = model.generate(feats, num_beams=1, do_sample=False, return_timestamps=True, return_segments=True, **kw)
    return [[(float(s["start"]), float(s["end"]), proc.decode(s["tokens"], skip_special_tokens=True).strip())
             for s in segs] for segs in out["segments"]]


def _assert_segments_equal(hyps, expected) -> None:
    """Same segment texts, times within 0.02 s; the concatenation (last) has several segments."""
    for h, exp in zip(hyps, expected, strict=True):
        got = [(s.start, s.end, s.text) for s in h.segments]
        assert [g[2] for g in got] == [e[2] for e in exp]
        assert np.allclose([g[:2] for g in got], [e[:2] for e in exp], atol=0.02, rtol=0)
    assert len(hyps[-1].segments) >= 3


@pytest.mark.slow
@pytest.mark.parametrize("name,picked,buckets", [("whisper-tiny.en", [0, 1, 2, 3, 4], (1, 8)),
                                                 ("whisper-base", [1, 4], (1, 2))],
                         ids=["whisper-tiny.en", "whisper-base"])
def test_segments_equal_transformers_on_real_speech(name, picked, buckets, one_thread, monkeypatch, librivox_clips,
                                                    hf_whisper):
    """Clips alone (tiny.en: the five, batch 8 bucket, 3 padding rows; base: the two 3 s ones,
    batch 2) and all five in one 24.7 s window (7 segments for base; batch 1, decoded apart
    from the clips: in their batch its ~100 steps would run for every row): same segment
    texts, times within 0.02 s."""
    from polyaccel.asr.runner import ASRRunner
    from polyaccel.asr.whisper import WhisperASR

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    clips = [librivox_clips[i] for i in picked]
    window = np.concatenate(librivox_clips)
    path = weights.resolve_model(name)
    kw = {"language": "en", "task": "transcribe"} if name == "whisper-base" else {}
    expected = _hf_segments(path, clips, hf_whisper, **kw) + _hf_segments(path, [window], hf_whisper, **kw)
    model = WhisperASR.from_pretrained(path, **kw)
    runner = ASRRunner(model, backend="cpu", batch_buckets=buckets, timestamps=True)
    hyps = runner.recognize(clips) + runner.recognize([window])
    _assert_segments_equal(hyps, expected)


@pytest.mark.gpu
def test_segments_on_cuda_with_graphs_equal_transformers(monkeypatch):
    """The timestamp rules inside the captured CUDA greedy step (a first GPU run failed every
    batch there): fp32 on the GPU, graphs on, the same segments as Transformers' on the clips and
    their concatenation. Weights: the first ``$POLYACCEL_TEST_WHISPER`` folder (carried to the
    GPU machine), else the installed whisper-base."""
    from polyaccel.asr.runner import ASRRunner
    from polyaccel.asr.whisper import WhisperASR

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = os.environ.get("POLYACCEL_TEST_WHISPER", "").split(",")[0] or "whisper-base"
    try:
        path = weights.resolve_model(name)
    except (ImportError, FileNotFoundError, weights.ModelNotInstalled) as e:
        pytest.skip(f"{name}: {e}")
    clips = _clips()
    audio = clips + [np.concatenate(clips)]
    config = json.loads((Path(path) / "config.json").read_text())
    kw = {"language": "en", "task": "transcribe"} if config.get("vocab_size", 0) >= 51865 else {}
    expected = _hf_segments(path, audio, **kw)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = WhisperASR.from_pretrained(path, **kw).cuda().eval()
    hyps = ASRRunner(model, backend="cuda", batch_buckets=(1, 8), timestamps=True).recognize(audio)
    _assert_segments_equal(hyps, expected)


@pytest.mark.slow
def test_long_file_segments_are_absolute_monotonic_and_cover_the_speech(one_thread, tmp_path):
    """~170 s of the clips with 1 s silences (7 windows): segments start at 0, never go back,
    leave no gap longer than a clip's pause plus a little, and reach the last clip."""
    import soundfile as sf

    from polyaccel.asr.transcriber import Transcriber
    from polyaccel.asr.wer import wer_counts

    clips = _clips()
    pieces, spans, t = [], [], 0.0
    for k in range(28):
        c = clips[k % len(clips)]
        pieces += [c, np.zeros(SR, np.float32)]
        spans.append((t, t + len(c) / SR))
        t += len(c) / SR + 1.0
    path = tmp_path / "long.wav"
    sf.write(path, np.concatenate(pieces), SR)
    with Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", replicas=1, batch_size=4,
                                     timestamps=True) as tr:
        own = [r.text for r in tr.transcribe(clips)]
        (r,) = tr.transcribe([str(path)])
    assert r.ok and r.windows == 7
    segs = r.segments
    starts, ends = [s["start"] for s in segs], [s["end"] for s in segs]
    assert starts[0] < 1.0 and ends[-1] > spans[-1][1] - 3.0
    assert all(a <= b for a, b in zip(starts, ends))
    assert all(e <= s2 + 1e-9 for e, s2 in zip(ends, starts[1:]))
    # every clip's stretch of audio overlaps some segment
    assert all(any(s["start"] < b and s["end"] > a for s in segs) for a, b in spans)
    ref = " ".join(own[k % len(clips)] for k in range(28))
    for hyp in (r.text, " ".join(s["text"] for s in segs)):  # 0.951 both (0.87 without decode_tail)
        c = wer_counts([ref], [hyp])
        assert 1 - (c.substitutions + c.deletions) / c.ref_words >= 0.94


# ---- SRT / VTT / txt export -------------------------------------------------------------------------

SEGS = [{"start": 0.0, "end": 2.5, "text": "Hello there."},
        {"start": 2.5, "end": 3661.0456, "text": "A <b> & c\n\nd"}]


def test_srt_and_vtt_golden():
    assert to_srt(SEGS) == ("1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
                            "2\n00:00:02,500 --> 01:01:01,046\nA <b> & c d\n\n")
    assert to_vtt(SEGS) == ("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello there.\n\n"
                            "00:00:02.500 --> 01:01:01.046\nA &lt;b&gt; &amp; c d\n\n")
    assert to_srt([]) == "" and to_vtt([]) == "WEBVTT\n\n"


def _results(tmp_path: Path, records: list[dict]) -> Path:
    p = tmp_path / "out.jsonl"
    p.write_text("".join(json.dumps({"path": "", "text": "", "duration_s": 1.0, "error": None, **r}) + "\n"
                         for r in records))
    return p


def test_export_files_names_overwrite_and_exit_codes(tmp_path, capsys):
    from polyaccel.asr.cli import main

    odd = b"/data/caf\xe9.wav"  # not UTF-8: the record's path shows \xNN, path_bytes is exact
    res = _results(tmp_path, [
        {"path": "clips/a.wav", "text": "Hello there.", "segments": SEGS[:1]},
        {"path": "other/a.flac", "text": "Again.", "segments": [{"start": 1, "end": 2, "text": "Again."}]},
        {"path": "/data/caf\\xe9.wav", "path_bytes": base64.b64encode(odd).decode(), "text": "Caf",
         "segments": []},
    ])
    out = tmp_path / "subs"
    assert main(["export", str(res), "--format", "srt", "-d", str(out), "-q"]) == 0
    names = sorted(os.listdir(os.fsencode(out)))
    assert names == [b"a-2.srt", b"a.srt", b"caf\xe9.srt"]
    assert (out / "a.srt").read_text() == "1\n00:00:00,000 --> 00:00:02,500\nHello there.\n\n"
    assert (out / "a-2.srt").read_text() == "1\n00:00:01,000 --> 00:00:02,000\nAgain.\n\n"
    # never overwritten unless asked
    (out / "a.srt").write_text("mine")
    assert main(["export", str(res), "-f", "srt", "-d", str(out), "-q"]) == 1  # the other two: up to date
    assert (out / "a.srt").read_text() == "mine"
    assert "exists with other content (--overwrite replaces it)" in capsys.readouterr().err
    assert main(["export", str(res), "-f", "srt", "-d", str(out), "--overwrite", "-q"]) == 0
    assert (out / "a.srt").read_text().startswith("1\n")
    assert main(["export", str(res), "-f", "txt", "-d", str(out), "-q"]) == 0
    assert (out / "a.txt").read_text() == "Hello there.\n"
    assert main(["export", str(res), "-f", "vtt", "-d", str(out), "-q"]) == 0
    assert (out / "a.vtt").read_text().startswith("WEBVTT\n\n00:00:00.000 --> 00:00:02.500\n")


def test_export_failed_records_and_usage_errors(tmp_path, capsys):
    from polyaccel.asr.cli import main

    res = _results(tmp_path, [
        {"path": "bad.wav", "error": "missing file"},
        {"path": "plain.wav", "text": "no timestamps"},        # transcribed without --timestamps
        {"path": "good.wav", "text": "ok", "segments": [{"start": 0, "end": 1, "text": "ok"}]},
    ])
    out = tmp_path / "subs"
    assert main(["export", str(res), "-f", "srt", "-d", str(out)]) == 1
    err = capsys.readouterr().err
    assert "skipped bad.wav: it failed (missing file)" in err
    assert "skipped plain.wav: no segments in the record (transcribe with --timestamps, into a new -o" in err
    assert sorted(os.listdir(out)) == ["good.srt"]
    assert main(["export", str(res), "-f", "txt", "-d", str(tmp_path / "t"), "-q"]) == 1  # bad.wav only
    assert main(["export", str(tmp_path / "nope.jsonl"), "-d", str(out)]) == 2
    tsv = tmp_path / "x.tsv"
    tsv.write_text("a\tb\n")
    assert main(["export", str(tsv), "-d", str(out)]) == 2
    assert main(["export", str(res), "-d", str(res)]) == 2  # -d is a file
    assert "not a folder" in capsys.readouterr().err


def test_export_never_replaces_its_results_file_and_survives_bad_segments(tmp_path, capsys):
    from polyaccel.asr.cli import main

    out = tmp_path / "subs"
    out.mkdir()
    res = out / "talk.txt"  # the results file, inside -d, named like the export of talk.wav
    res.write_text("".join(json.dumps({"duration_s": 1.0, "error": None, **r}) + "\n" for r in [
        {"path": "clips/talk.wav", "text": "hello"},
        {"path": "inf.wav", "text": "x", "segments": [{"start": 1e400, "end": 2, "text": "a"}]},
        {"path": "str.wav", "text": "x", "segments": ["oops"]},
        {"path": "nokey.wav", "text": "x", "segments": [{"text": "a"}]},
    ]))
    before = res.read_bytes()
    assert main(["export", str(res), "-f", "txt", "-d", str(out), "--overwrite", "-q"]) == 1
    assert res.read_bytes() == before
    assert "is the results file itself" in capsys.readouterr().err
    assert main(["export", str(res), "-f", "srt", "-d", str(tmp_path / "s"), "-q"]) == 3
    assert capsys.readouterr().err.count("malformed segments") == 3


def test_a_seam_does_not_repeat_a_sentence_for_the_pause_its_segment_runs_over():
    """Whisper's segments run over the pauses after them. The five LibriVox clips with 2 s pauses
    (32.73 s; windows [0, 30] and [2.73, 32.73]) and tiny.en's segments of each window: window 1's
    first segment, the end of clip 0 ("to consider ... for them."), runs to 9.41 s over the pause
    that window 0's copy (to 7.22 s) leaves out, and the seam kept it, a sentence said twice in
    the subtitles. Counted in seconds of speech, leaving the pause out costs nothing."""
    rng = np.random.default_rng(0)
    clips = [(0.0, 7.1), (9.1, 12.09), (14.09, 19.39), (21.39, 27.44), (29.44, 32.73)]
    audio = np.zeros(round(32.73 * SR), np.float32)
    for a, b in clips:
        audio[round(a * SR):round(b * SR)] = 0.1 * rng.standard_normal(round(b * SR) - round(a * SR))
    A = "And Mr. John Dashwood had then leisure to consider how much there might be prudently in his power to do for them."
    B, C = "He was not an ill-disposed young man.", "Unless to be rather cold-hearted and rather selfish is to be ill-disposed."
    D1, D2 = "Had he married a more amiable woman he might have been made still more respectable than", "he was."
    E = "might even have been made amiable himself."
    said = {0: [(0.0, 7.22, A), (9.22, 12.22, B), (14.22, 19.46, C), (21.5, 27.5, D1 + " " + D2)],
            round(2.73 * SR): [(0.0, 6.68, A[A.index("to consider"):]), (6.68, 11.68, B), (11.68, 19.08, C),
                             (19.08, 23.76, D1), (23.76, 27.04, D2), (27.04, 29.64, E)]}

    def recognize(batch):
        out = []
        for x in batch:
            start = next((k for k in said if len(x) == 30 * SR and np.array_equal(x, audio[k:k + len(x)])), None)
            segs = [Segment(*s) for s in said.get(start, [])]  # a tail decoded again: nothing more
            out.append(TimedText(" ".join(s.text for s in segs), segs))
        return out

    from polyaccel.asr.transcriber import Transcriber

    with Transcriber(lambda i: recognize, sample_rate=SR, max_audio_seconds=30.0, replicas=1, batch_size=8) as tr:
        (r,) = tr.transcribe([audio])
    assert " ".join(s["text"] for s in r.segments) == " ".join([A, B, C, D1, D2, E])  # each sentence once
    assert all(x["end"] <= y["start"] for x, y in zip(r.segments, r.segments[1:]))


def test_a_segment_over_speech_too_quiet_to_measure_is_still_kept():
    """Counting seams in seconds of speech must not drop what only one window heard where the
    energy measure finds no speech (quiet speech): window 1's "q" (20-25 s, no loud frames) is
    the only segment there, so it stays (with seconds of no speech counted as nothing it went,
    the cut nearest the middle of the shared 20-30 s winning the tie)."""
    w0 = [Segment(0.0, 10.0, "a"), Segment(10.0, 20.0, "b")]
    w1 = [Segment(0.0, 5.0, "q"), Segment(5.0, 30.0, "c")]
    got = stitch_segments([w0, w1], [(0.0, 30.0), (20.0, 50.0)], [[(0.0, 20.0)], [(5.0, 30.0)]])
    assert [s.text for s in got] == ["a", "b", "q", "c"]


# ---- a sentence said twice, once outside the audio two windows share -------------------------------

C3 = "Had he married a more amiable woman, he might have been made still more respectable than he was."
C4 = "He might even have been made amiable himself."


def _timed(*segs: tuple[float, float, str]) -> TimedText:
    return TimedText(" ".join(t for *_, t in segs), [Segment(*s) for s in segs])


def test_seam_searches_words_said_twice_only_in_the_shared_audio():
    """tiny.en's windows [15, 45] and [30, 60] s of the LibriVox clips in the order 0 1 2 3 4 4 3
    2 1 0 2 0 4 with 3 s pauses, at ``--overlap 15``. Both windows say clip 3 ("Had he married
    ... he was.", 18 words), at 25-34 s and at 46-55 s, both outside the shared 30-45 s; the
    seam guessed from the lengths that 37 and 33 words could lie there, took the two copies
    for the overlap and lost the two clip-4 sentences between them and the second clip 3. The
    words. times say 19 and 16 (with a second of slack)."""
    from polyaccel.asr.audio import stitch
    from polyaccel.asr.timestamps import seam_word_counts

    left = _timed((1.38, 9.8, "Unless to be rather cold-hearted and rather selfish is to be ill-disposed."),
                  (9.8, 14.64, C3[:C3.index(" he was.")]), (14.64, 18.76, "he was."), (18.76, 25.04, C4),
                  (25.04, 27.64, C4[3:]))
    right = _timed((0.0, 10.0, C4), (10.0, 16.4, C4), (16.4, 25.32, C3),
                   (25.32, 30.04, "unless to be rather cold-hearted and rather selfish, is to be ill-disposed."))
    spans = [(15.0, 45.0), (30.0, 60.0)]
    counts = seam_word_counts([left, right], spans)
    assert counts == [(19, 16)]
    text = stitch([left, right], spans, counts)
    assert text.count("respectable") == 2 and text.count("amiable himself") == 2, text  # as in 25-60 s
    assert text.endswith(f"{C4} {C3} unless to be rather cold-hearted and rather selfish, is to be ill-disposed.")
    assert seam_word_counts(["plain", "text"], spans) is None  # without timestamps: the old guess


@pytest.mark.slow
def test_a_sentence_said_twice_far_apart_keeps_its_words_at_overlap_15(one_thread):
    """The LibriVox clips in the order 0 1 2 3 4 4 3 2 with 3 s pauses (60.4 s), tiny.en,
    ``--overlap 15 --timestamps``: the text lost both clip-4 sentences and the second clip 3
    (see the test above; of the 95 s file that goes on 1 0 2 0 4, 35 of 184 words); now each
    clip is there as often as it is said."""
    from polyaccel.asr.transcriber import Transcriber

    clips = _clips()
    order = [0, 1, 2, 3, 4, 4, 3, 2]
    pause = np.zeros(3 * SR, np.float32)
    audio = np.concatenate([x for i in order for x in (clips[i], pause)][:-1])
    with Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", replicas=1, batch_size=4,
                                     timestamps=True, overlap_s=15.0) as tr:
        (r,) = tr.transcribe([audio])
    assert r.ok and r.windows == 4
    said = r.text.lower()
    for phrase, times in [("dashwood", 1), ("young man", 1), ("rather selfish", 2), ("respectable", 2),
                          ("amiable himself", 2)]:
        assert said.count(phrase) == times, (phrase, r.text)


# ---- subtitles over long pauses --------------------------------------------------------------------


@pytest.mark.slow
def test_a_cue_ends_with_its_speech_not_at_the_next_speech_after_a_long_pause(one_thread):
    """LibriVox clips 2, 3, 4 with 10 s pauses (34.6 s), tiny.en: Whisper ended clip 3's segment
    at 31.64 s, just after clip 4 starts (31.35 s), so the subtitle stayed on screen over the
    whole 10 s pause after its speech (which ends at 21.35 s), and clip 2's at 7.0 s (its speech
    ends at 5.3 s). Now each cue ends within a second after its clip's speech."""
    from polyaccel.asr.transcriber import Transcriber

    clips = [_clips()[i] for i in (2, 3, 4)]
    pause = np.zeros(10 * SR, np.float32)
    audio = np.concatenate([clips[0], pause, clips[1], pause, clips[2]])
    ends = np.cumsum([len(c) / SR + 10 for c in clips]) - 10  # 5.3, 21.35, 34.64
    with Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", replicas=1, batch_size=4,
                                     timestamps=True) as tr:
        (r,) = tr.transcribe([audio])
    segs = r.segments
    for last_words, end in zip(["ill-disposed.", "he was.", "himself."], ends):
        (cue,) = [s for s in segs if s["text"].endswith(last_words)]
        assert end - 0.5 <= cue["end"] <= end + 1.0, (cue, end)
    assert all(s["start"] <= s["end"] for s in segs)
    assert all(x["end"] <= y["start"] for x, y in zip(segs, segs[1:]))


def test_clip_ends_to_speech_rules():
    """Ends move back to half a second after the voice only over 1.5 s or more without voice; a
    short sound at a segment's end after such a pause is the next speech's start; a segment with
    no voice, or one whose pauses are short, keeps its end; no end goes before its start."""
    from polyaccel.asr.timestamps import clip_ends_to_speech

    voice = [(0.5, 3.0), (13.0, 13.4), (20.0, 22.0), (22.8, 24.0), (40.0, 45.0), (50.0, 51.5)]
    segs = [Segment(0.0, 13.4, "a"), Segment(13.4, 19.0, "b"), Segment(19.5, 25.0, "c"),
            Segment(30.0, 38.0, "quiet"), Segment(39.0, 51.5, "d"), Segment(52.0, 60.0, "e")]
    got = clip_ends_to_speech(segs, voice)
    assert [(s.start, s.end) for s in got] == [(0.0, 3.5), (13.4, 19.0), (19.5, 25.0), (30.0, 38.0),
                                                (39.0, 51.5), (52.0, 60.0)]
    assert clip_ends_to_speech([Segment(2.9, 9.0, "x")], [(0.0, 3.0)]) == [Segment(2.9, 3.5, "x")]
    assert clip_ends_to_speech([Segment(2.99, 9.0, "x")], [(0.0, 3.0)])[0].end >= 2.99


def test_voice_is_measured_against_the_audio_s_own_noise_floor():
    """Hiss at -40 dBFS (above the -46 dBFS the word-rate check calls speech) is not voice; tones
    15 dB and more above it are. So is everything when the hiss is as loud as they are."""
    from polyaccel.asr.audio import voice_spans

    rng = np.random.default_rng(0)
    audio = 0.01 * rng.standard_normal(20 * SR).astype(np.float32)
    t = np.arange(2 * SR) / SR
    audio[5 * SR:7 * SR] += 0.1 * np.sin(2 * np.pi * 200 * t).astype(np.float32)
    audio[12 * SR:14 * SR] += 0.08 * np.sin(2 * np.pi * 300 * t).astype(np.float32)
    assert voice_spans(audio, SR) == [(5.0, 7.0), (12.0, 14.0)]
    assert voice_spans(audio + 0.1 * rng.standard_normal(len(audio)).astype(np.float32), SR) == [(0.0, 20.0)]


# ---- cues that cannot be shown, or say nothing ---------------------------------------------------


@pytest.mark.slow
def test_a_one_sample_file_gets_a_cue_that_can_be_shown_and_a_lone_full_stop_none(one_thread):
    """tiny.en with timestamps on one sample of silence says "you" from 0.0 to 0.0 s (times are
    kept within the audio), which was the cue 00:00:00,000 --> 00:00:00,000 that no player
    shows; on 16 samples of a constant it says "." (0.0-0.001 s), which was a cue of a full stop.
    Now the first lasts half a second and the second is no cue (the record keeps both)."""
    from polyaccel.asr.transcriber import Transcriber

    with Transcriber.from_pretrained("whisper-tiny.en", backend="cpu", replicas=1, batch_size=2,
                                     timestamps=True) as tr:
        one, dot = tr.transcribe([np.zeros(1, np.float32), np.full(16, 0.1, np.float32)])
    assert one.segments == [{"start": 0.0, "end": 0.0, "text": "you"}]
    assert to_srt(one.segments) == "1\n00:00:00,000 --> 00:00:00,500\nyou\n\n"
    assert to_vtt(one.segments) == "WEBVTT\n\n00:00:00.000 --> 00:00:00.500\nyou\n\n"
    assert dot.text == "." and [s["text"] for s in dot.segments] == ["."]
    assert to_srt(dot.segments) == "" and to_vtt(dot.segments) == "WEBVTT\n\n"


def test_short_cues_last_half_a_second_without_running_into_the_next_and_punctuation_is_no_cue():
    segs = [{"start": 1.0, "end": 1.0, "text": "a"}, {"start": 1.2, "end": 1.25, "text": "b"},
            {"start": 1.25, "end": 1.3, "text": " ... "}, {"start": 3.0, "end": 2.0, "text": "c"},
            {"start": 3.0, "end": 3.1, "text": "d"}, {"start": 4.0, "end": 4.2, "text": "♪"},
            {"start": 5.0, "end": 9.0, "text": "«—?!»"}, {"start": 9.0, "end": 9.1, "text": "e."}]
    assert to_srt(segs).split("\n\n")[:-1] == [
        "1\n00:00:01,000 --> 00:00:01,200\na",  # up to b's start
        "2\n00:00:01,200 --> 00:00:01,700\nb",  # the dots after it are no cue
        "3\n00:00:03,000 --> 00:00:03,500\nc",  # d starts with it: no later start to stop at
        "4\n00:00:03,000 --> 00:00:03,500\nd",
        "5\n00:00:04,000 --> 00:00:04,500\n♪",  # a symbol, not punctuation: music
        "6\n00:00:09,000 --> 00:00:09,500\ne."]
