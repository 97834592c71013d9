"""Audio decoding, bad-input errors, long-audio windows and stitching, manifests, the resumable
results file and the WER normalizer (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr.audio import (
    AudioError,
    RawFormat,
    audio_duration,
    bucket_order,
    load_audio,
    merge_overlap,
    prepare_waveform,
    split_windows,
    stitch,
    window_bounds,
)
from polyaccel.asr.manifest import ResultsWriter, expand_inputs, load_results, read_manifest, read_refs
from polyaccel.asr.text import normalize_text, number_to_words
from polyaccel.asr.wer import wer, wer_counts

SR = 16000


def _tone(seconds: float, rate: int = SR, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture
def wav(tmp_path: Path) -> Path:
    p = tmp_path / "tone.wav"
    sf.write(p, _tone(1.0), SR, subtype="PCM_16")
    return p


# ---- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,ext", [("WAV", ".wav"), ("FLAC", ".flac"), ("OGG", ".ogg")])
def test_formats_decode_to_mono_float32(tmp_path: Path, fmt: str, ext: str) -> None:
    x = _tone(0.5)
    p = tmp_path / f"a{ext}"
    sf.write(p, x, SR, format=fmt)
    y = load_audio(p)
    assert y.dtype == np.float32 and y.ndim == 1
    assert abs(len(y) - len(x)) <= 1
    assert np.abs(y).max() <= 1.0
    if fmt != "OGG":  # lossless formats give back the samples
        np.testing.assert_allclose(y, x, atol=1e-3)
    assert audio_duration(p) == pytest.approx(0.5, abs=1e-3)


def test_8khz_stereo_is_resampled_and_mixed_down(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    left = _tone(1.0, 8000, 300.0)
    right = _tone(1.0, 8000, 300.0) * 0.5 + 0.01 * rng.standard_normal(8000).astype(np.float32)
    p = tmp_path / "stereo8k.wav"
    sf.write(p, np.stack([left, right], 1), 8000, subtype="FLOAT")
    y = load_audio(p)
    assert len(y) == SR
    ref = _tone(1.0, SR, 300.0) * 0.75
    # soxr's HQ filter is nearly transparent for a 300 Hz tone (skip the edges).
    np.testing.assert_allclose(y[200:-200], ref[200:-200], atol=0.02)


def test_raw_pcm_with_declared_rate(tmp_path: Path) -> None:
    x = _tone(0.25, 8000)
    p = tmp_path / "a.pcm"
    p.write_bytes((x * 32767).astype("<i2").tobytes())
    y = load_audio(p, raw=RawFormat(sample_rate=8000))
    assert len(y) == 4000
    assert audio_duration(p, RawFormat(sample_rate=8000)) == pytest.approx(0.25)


def test_int_and_float_arrays_are_prepared() -> None:
    ints = (np.ones(100) * 16384).astype(np.int16)
    assert prepare_waveform(ints, SR).max() == pytest.approx(0.5, abs=1e-4)
    loud = np.full(10, 3.0, np.float32)
    assert prepare_waveform(loud, SR).max() == 1.0


@pytest.mark.parametrize("case,message", [
    ("missing", "missing file"),
    ("zero_bytes", "empty file"),
    ("text_as_wav", "not an audio file"),
    ("truncated", "truncated"),
    ("header_only", "empty audio"),
    ("garbage_binary", "unsupported audio format"),
    ("garbage_mp3", r"corrupt or truncated audio \(Format not recognised"),  # not "file does not exist"
    ("corrupt_riff", "corrupt"),
    ("nan", "NaN"),
    ("directory", "directory"),
])
def test_bad_inputs_raise_short_audio_errors(tmp_path: Path, wav: Path, case: str, message: str) -> None:
    p = tmp_path / "bad.wav"
    data = wav.read_bytes()
    if case == "missing":
        p = tmp_path / "nope.wav"
    elif case == "zero_bytes":
        p.write_bytes(b"")
    elif case == "text_as_wav":
        p.write_text("this is not audio\n")
    elif case == "truncated":
        p.write_bytes(data[: len(data) // 2])
    elif case == "header_only":
        sf.write(p, np.zeros(0, np.float32), SR)
    elif case == "garbage_binary":
        p = tmp_path / "bad.xyz"
        p.write_bytes(bytes(range(256)) * 4)
    elif case == "garbage_mp3":
        p = tmp_path / "bad.mp3"
        p.write_bytes(bytes(range(256)) * 20)
    elif case == "corrupt_riff":
        p.write_bytes(b"RIFF" + bytes(range(256)) * 4)
    elif case == "nan":
        x = _tone(0.1)
        x[10] = np.nan
        sf.write(p, x, SR, subtype="FLOAT")
    elif case == "directory":
        p = tmp_path
    with pytest.raises(AudioError, match=message) as e:
        load_audio(p)
    assert len(str(e.value)) < 120 and "\n" not in str(e.value)


def test_a_header_saying_1_hz_is_an_error_not_hours_of_audio(tmp_path: Path) -> None:
    """48,000 samples at "1 Hz" would be 13 hours of audio resampled to 16 kHz."""
    from polyaccel.asr.audio import stream_audio
    from polyaccel.asr.transcriber import Transcriber

    p = tmp_path / "rate1.wav"
    sf.write(p, _tone(3.0), SR, subtype="PCM_16")
    data = bytearray(p.read_bytes())
    data[24:32] = (1).to_bytes(4, "little") + (2).to_bytes(4, "little")  # sample rate, byte rate
    p.write_bytes(bytes(data))
    for read in (audio_duration, load_audio, lambda q: list(stream_audio(q))):
        with pytest.raises(AudioError, match="implausible sample rate"):
            read(p)
    with pytest.raises(AudioError, match="implausible sample rate"):
        prepare_waveform(_tone(1.0), 1)
    with Transcriber(lambda i: lambda batch: ["x"] * len(batch)) as tr:
        r = tr.transcribe([str(p), (_tone(1.0), 8000)])
    assert "implausible sample rate" in r[0].error and r[1].ok


# ---- long audio ------------------------------------------------------------------------------


def test_windows_cover_two_hours_without_copying() -> None:
    audio = np.zeros(2 * 3600 * SR, np.float32)  # 460 MB of silence stands in for a 2 h file
    bounds = window_bounds(len(audio), SR, 30.0, 3.0)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(audio)
    for (_a0, a1), (b0, b1) in zip(bounds, bounds[1:]):
        assert b0 < a1, "consecutive windows must overlap"
        assert a1 - b0 <= 3 * SR or b1 == len(audio)  # the last one is shifted left to be full
    assert all(b - a <= 30 * SR for a, b in bounds)
    assert len(bounds) == pytest.approx(7200 / 27, abs=2)
    windows = split_windows(audio, SR, 30.0)
    first = next(windows)
    assert np.shares_memory(first.audio, audio), "windows must be views, not copies"
    assert sum(1 for _ in windows) + 1 == len(bounds)


@pytest.mark.parametrize("n", [1, SR * 30, SR * 30 + 1, SR * 57, SR * 61])
def test_window_bounds_edge_cases(n: int) -> None:
    bounds = window_bounds(n, SR, 30.0, 3.0)
    covered = np.zeros(n, bool)
    for a, b in bounds:
        assert 0 <= a < b <= n and b - a <= 30 * SR
        covered[a:b] = True
    assert covered.all()


def test_merge_overlap_drops_repeated_words() -> None:
    left = "it is a truth universally acknowledged that a single man in posse"
    right = "man in possession of a good fortune must be in want of a wife"
    assert merge_overlap(left, right) == (
        "it is a truth universally acknowledged that a single man in possession of a good "
        "fortune must be in want of a wife")
    # Case and punctuation differences at the seam do not matter.
    assert merge_overlap("He was not an ill-disposed young Man,", "young man. Unless to be") == (
        "He was not an ill-disposed young Man, Unless to be")
    # No overlap: plain concatenation; a lone short common word is not trusted.
    assert merge_overlap("hello there", "general kenobi") == "hello there general kenobi"
    assert merge_overlap("one of", "of two") == "one of of two"
    # A phrase repeated far from the seam must not be taken for the overlap.
    left = "the end of it and mister john dashwood had then leisure to consider how much he could do for them " \
           "he was not an ill disposed young man and mister john"
    right = "mister john dashwood had then leisure to consider"
    assert merge_overlap(left, right) == (
        "the end of it and mister john dashwood had then leisure to consider how much he could do for them "
        "he was not an ill disposed young man and mister john dashwood had then leisure to consider")
    assert stitch(["alpha beta gamma delta", "gamma delta epsilon", "", "epsilon zeta"]) == (
        "alpha beta gamma delta epsilon zeta")



def test_a_phrase_said_twice_near_the_seam_is_no_overlap() -> None:
    """whisper-base on the LibriVox clips concatenated with 3 s pauses (101 s): window 1 [27,
    57] s left out the end of the sentence window 0 cuts ("than he was", 27-30.4 s), so the two
    texts share no words; "have been made", 6 words before the end of one and 3 after the start
    of the other, was taken for the overlap and two sentences between were lost."""
    a = ("And Mr. John Dashwood had then leisure to consider how much there might be prudently in his power "
         "to do for them. He was not an ill-disposed young man. Unless to be rather cold-hearted and rather "
         "selfish is to be ill-disposed. Had he married a more amiable woman, he might have been made still "
         "more respectable than he was.")
    b = ("He might even have been made amiable himself. Had he married a more amiable woman, he might have "
         "been made still more respectable than he was.")
    assert stitch([a, b], [(0.0, 30.0), (27.0, 57.0)]) == a + " " + b
    # Windows that share nearly all their audio (a 31 s file: [0, 30] and [1, 31] s) but heard three
    # words differently: no run is long, yet the texts agree word for word around each; kept once.
    w = a.split()
    r = list(w)
    r[12], r[30], r[45] = "me", "bother", "fairly"
    assert stitch([a, " ".join(r)], [(0.0, 30.0), (1.0, 31.0)]).split() in (w[:k] + r[k:] for k in range(len(w) + 1))
    # Windows that share no audio (--overlap 0) can both hold only the word their cut halves: "he
    # was" ending one and starting the next is said twice (LibriVox clips with 3 s pauses, 101 s,
    # tiny.en at --overlap 0 lost the second), a halved "ill-disposed" once.
    assert stitch(["than he was.", "He was not an ill-disposed young man."], [(0.0, 30.0), (30.0, 60.0)]) == (
        "than he was. He was not an ill-disposed young man.")
    assert stitch(["not an ill-disposed", "ill-disposed young man."], [(0.0, 30.0), (30.0, 60.0)]) == (
        "not an ill-disposed young man.")
    # Words cut at the edges still let the run be found: 2 words around a run of 3.
    assert merge_overlap("then he was not an ill", "not an ill-disposed young man") == "then he was not an ill-disposed young man"


def test_stitch_uses_window_spans_against_repeated_speech() -> None:
    """Real Whisper tiny.en output for a 46.5 s file whose second window overlaps the first by
    13.5 s; the audio repeats its first sentences, and the model dropped the words cut by the
    first window's end. The seam must match "had he married ... himself", not the repeat."""
    a = ("And Mr. John Dashwood had then leisure to consider how much there might be prudently in his "
         "power to do for them. He was not an ill-disposed young man. Unless to be rather cold-hearted and "
         "rather selfish is to be ill-disposed. Had he married a more amiable woman he might have been made "
         "still more respectable than he was. He might even have been made amiable himself.")
    b = ("had he married a more amiable woman he might have been made still more respectable than he was. "
         "He might even have been made amiable himself. And Mr. John Dashwood had then leisure to consider "
         "how much there might be prudently in his power to do for them.")
    out = stitch([a, b], [(0.0, 30.0), (16.52, 46.52)])
    assert out == a + " And Mr. John Dashwood had then leisure to consider how much there might be " \
                      "prudently in his power to do for them."


def test_bucket_order_groups_by_duration_within_blocks() -> None:
    rng = np.random.default_rng(1)
    d = list(rng.uniform(1, 30, 100))
    order = bucket_order(d, group=4)
    assert sorted(order) == list(range(100))
    for s in range(0, 100, 32):
        block = order[s:s + 32]
        assert set(block) == set(range(s, min(s + 32, 100)))
        assert [d[i] for i in block] == sorted((d[i] for i in block), reverse=True)


# ---- manifests, references, results file -----------------------------------------------------


def test_expand_inputs_dirs_manifests_and_missing(tmp_path: Path, wav: Path) -> None:
    sub = tmp_path / "d" / "e"
    sub.mkdir(parents=True)
    sf.write(sub / "b.flac", _tone(0.1), SR)
    (sub / "notes.txt").write_text("x")
    man = tmp_path / "m.jsonl"
    man.write_text(json.dumps({"audio_filepath": "tone.wav", "text": "Hello"}) + "\n\n"
                   + json.dumps({"path": str(sub / "b.flac")}) + "\n")
    items = expand_inputs([tmp_path / "d", man, tmp_path / "missing.wav"])
    assert [Path(i.path).name for i in items] == ["b.flac", "tone.wav", "missing.wav"]
    assert items[1].ref == "Hello" and items[0].ref is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no path"}\n')
    with pytest.raises(ValueError, match="audio_filepath"):
        read_manifest(bad)


def test_read_refs_sphinx_and_jsonl(tmp_path: Path) -> None:
    s = tmp_path / "transcription"
    s.write_text("<s> he was not an ill disposed young man </s> (utt-0880)\n"
                 "<s> hello </s> (a b)\n")
    assert read_refs(s) == {"utt-0880": "he was not an ill disposed young man", "a b": "hello"}
    j = tmp_path / "refs.jsonl"
    j.write_text('{"path": "/x/y/z.wav", "text": "hi"}\n{"id": "q", "text": "yo"}\n')
    assert read_refs(j) == {"/x/y/z.wav": "hi", "z": "hi", "q": "yo"}


def test_results_writer_resumes_and_repairs(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    with ResultsWriter(out) as w:
        w.write({"path": "a.wav", "text": "a", "error": None})
        w.write({"path": "b.wav", "text": "", "error": "missing file"})
        w.write({"path": "c.wav", "text": "c", "error": None})
    with open(out, "a") as f:
        f.write('{"path": "d.wav", "te')  # a crash in the middle of a line
    w = ResultsWriter(out)
    assert w.done == {"a.wav", "c.wav"}
    w.write({"path": "b.wav", "text": "b", "error": None})
    w.write({"path": "d.wav", "text": "d", "error": None})
    w.close()
    lines = out.read_text().splitlines()
    assert all(json.loads(line) for line in lines)
    assert sorted(r["path"] for r in load_results(out)) == ["a.wav", "b.wav", "c.wav", "d.wav"]
    with ResultsWriter(out, resume=False) as w:
        assert w.done == set()
    assert out.read_text() == ""


# ---- normalizer and WER ------------------------------------------------------------------------


@pytest.mark.parametrize("a,b", [
    ("Mr. John Dashwood", "mister john dashwood"),
    ("He won't pay $5.", "he will not pay five dollars"),
    ("the 21st century", "the twenty-first century"),
    ("In 1995, 1,000 people", "in nineteen ninety five one thousand people"),
    ("Uh, the colour [noise] is   GREY!", "the color is gray"),
    ("It's 50% off", "it's fifty percent off"),
    ("café déjà vu", "cafe deja vu"),
    ("They paid $1.5 million in the 1990s.", "they paid one point five million dollars in the nineteen nineties"),
    ("$2.5 and $10.5 billion", "two point five dollars and ten point five billion dollars"),
    ("$1, £5, €3 million", "one dollar five pounds three million euros"),
    ("$2.50, $0.50 and $1.01", "two dollars fifty cents fifty cents and one dollar one cent"),
    ("the 1900s, the '80s", "the nineteen hundreds the eighties"),
])
def test_normalizer_equates_spellings(a: str, b: str) -> None:
    assert normalize_text(a) == normalize_text(b)


def test_number_words() -> None:
    assert number_to_words(0) == "zero"
    assert number_to_words(105) == "one hundred five"
    assert number_to_words(2_000_017) == "two million seventeen"


def test_wer_values() -> None:
    assert wer(["and mister john dashwood"], ["And Mr. John Dashwood."]) == 0.0
    c = wer_counts(["a b c d", "x y"], ["a q c", "x y z"])
    assert (c.substitutions, c.deletions, c.insertions, c.ref_words) == (1, 1, 1, 6)
    assert c.wer == pytest.approx(0.5)
    assert wer([""], [""]) == 0.0
    with pytest.raises(ValueError):
        wer(["a"], [])


def test_a_manifest_giving_one_file_two_texts_is_refused(tmp_path: Path) -> None:
    """The second line's text was dropped without a word, so WER scored against whichever came
    first; the same text twice, or a line without text, is fine."""
    m = tmp_path / "m.jsonl"
    m.write_text('{"path": "a.wav", "text": "one"}\n{"path": "./a.wav", "text": "one"}\n{"path": "a.wav"}\n')
    assert [it.ref for it in read_manifest(m)] == ["one", "one", None]
    m.write_text('{"path": "a.wav", "text": "one"}\n{"path": "b.wav", "text": "two"}\n'
                 '{"path": "./a.wav", "text": "won"}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:3: '\./a\.wav' has another 'text' on line 1"):
        read_manifest(m)
