"""Guards against bugs that would silently corrupt output (wrong text, wrong times, lost or
duplicated records), each added for a plausible one-line bug the other tests let through:
re-decoding of windows that stopped early (in two-window files, from the first window's start,
never for fewer words, with segment times), streamed and whole-file audio (channel mixing,
upsampling, integer PCM, truncation, window edges), the results file, timestamps and subtitle
formatting, greedy decoding (suppression, early stop), WER, references, a long file whose later
window fails, and the CLI's exit status after a rerun or a write error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from polyaccel.asr.decoding import Segment
from polyaccel.asr.timestamps import TimedText
from polyaccel.asr.transcriber import Transcriber

SR = 16000

# ---- re-decoding windows that stopped early ------------------------------------------------------

WORD_S, GAP_S = 0.4, 0.13
PERIOD_S = WORD_S + GAP_S


def _spoken(n: int, lead_gap: bool = True) -> np.ndarray:
    """Word k is GAP_S of silence then WORD_S of the constant 0.05 + k / 2000; without
    ``lead_gap`` the first word starts at the very first sample (as real speech may)."""
    word, gap = int(WORD_S * SR), int(GAP_S * SR)
    out = np.zeros(n * (word + gap), np.float32)
    for k in range(n):
        out[k * (word + gap) + gap: (k + 1) * (word + gap)] = 0.05 + k / 2000
    return out if lead_gap else out[gap:]


def _runs(a: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, word id) of each stretch of one word at least 0.2 s long."""
    edges = np.flatnonzero(np.diff(np.r_[0.0, (a != 0).astype(float), 0.0]))
    return [(s, e, round((float(a[s]) - 0.05) * 2000)) for s, e in zip(edges[::2], edges[1::2])
            if e - s >= 0.2 * SR]


def _says_one_word_when_long(batch: list[np.ndarray]) -> list[str]:
    """Like Whisper without timestamps on a full 30 s window of running speech: stops after the
    first word. Shorter audio (the re-decoded pieces) is transcribed in full."""
    out = []
    for a in batch:
        words = [f"w{k}" for _, _, k in _runs(a)]
        out.append(" ".join(words[:1] if len(a) > 20 * SR else words))
    return out


def test_two_window_file_that_starts_with_a_word_keeps_every_word() -> None:
    """~50 s, speech from the first sample: two windows, both stopping after one word. Both
    are re-decoded in pieces (a two-window file is long audio too), and the first window keeps
    its first word (no head is skipped there: no earlier window holds it)."""
    n = 95
    audio = _spoken(n, lead_gap=False)
    with Transcriber(lambda i: _says_one_word_when_long, sample_rate=SR, replicas=1, batch_size=4) as tr:
        (r,) = tr.transcribe([audio])
    assert r.windows == 2
    assert r.text == " ".join(f"w{k}" for k in range(n))


def test_a_re_decoding_with_fewer_words_is_not_kept() -> None:
    """A window that says too few words is decoded again; if the pieces say even fewer, the
    window's own transcript stays."""
    def recognize(batch: list[np.ndarray]) -> list[str]:
        return [" ".join(f"{c}{_runs(a)[0][2]}" for c in "abcd") if len(a) > 20 * SR else "x" for a in batch]

    with Transcriber(lambda i: recognize, sample_rate=SR, replicas=1, batch_size=4) as tr:
        (r,) = tr.transcribe([_spoken(95)])
    assert r.windows == 2
    first = [k for _, _, k in _runs(_spoken(95)[int(20.35 * SR):])][0]
    assert r.text == f"a0 b0 c0 d0 a{first} b{first} c{first} d{first}"


def _timed_one_word_when_long(batch: list[np.ndarray]) -> list[TimedText]:
    """With timestamps: a full window that starts inside a word says one word, in a segment
    running to the window's end (so no tail is left to decode); otherwise one segment per word."""
    out = []
    for a in batch:
        runs = _runs(a)
        if a[0] != 0 and len(a) > 20 * SR:
            s, _, k = runs[0]
            out.append(TimedText(f"w{k}", [Segment(round(s / SR, 2), round(len(a) / SR, 2), f"w{k}")]))
        else:
            out.append(TimedText(" ".join(f"w{k}" for *_, k in runs),
                                 [Segment(round(s / SR, 2), round(e / SR, 2), f"w{k}") for s, e, k in runs]))
    return out


def test_re_decoded_pieces_keep_absolute_segment_times() -> None:
    """The second window starts inside a word, stops after it and is decoded again without the
    head before its first pause: the pieces' segments are shifted by that head too, so every
    word's segment is where the word is in the file."""
    n = 95
    audio = _spoken(n)
    with Transcriber(lambda i: _timed_one_word_when_long, sample_rate=SR, replicas=1, batch_size=4) as tr:
        (r,) = tr.transcribe([audio])
    assert r.windows == 2 and r.segments is not None
    assert [s["text"] for s in r.segments] == [f"w{k}" for k in range(n)]
    for k, s in enumerate(r.segments[:-1]):  # the last word ends where the file does
        assert s["start"] == pytest.approx(k * PERIOD_S + GAP_S, abs=0.02), (k, s)
        assert s["end"] == pytest.approx((k + 1) * PERIOD_S, abs=0.02), (k, s)


# ---- audio: window edges, truncation ---------------------------------------------------------------


@pytest.mark.parametrize("seconds", [30.0, 30.0 + 27.0, 30.0 + 2 * 27.0])
@pytest.mark.parametrize("block_s", [7.0, 27.0, 100.0])
def test_streamed_windows_of_audio_ending_on_a_window_edge(seconds: float, block_s: float) -> None:
    """Audio that ends exactly where a window ends: the streamed windows are still the
    whole-file windows (no second copy of the last window, whose words would be said twice)."""
    from polyaccel.asr.audio import split_windows, stream_windows

    audio = np.random.default_rng(0).uniform(-0.5, 0.5, int(seconds * SR)).astype(np.float32)
    step = int(block_s * SR)
    blocks = [audio[i:i + step] for i in range(0, len(audio), step)]
    got = list(stream_windows(blocks, SR, 30.0, 3.0))
    expected = list(split_windows(audio, SR, 30.0, 3.0))
    assert [(w.index, w.start_s, len(w.audio)) for w in got] == [(w.index, w.start_s, len(w.audio)) for w in expected]
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g.audio, e.audio)


def test_an_ogg_file_cut_at_a_page_boundary_is_truncated(tmp_path: Path) -> None:
    """An Ogg file that lost its last pages whole (every remaining page intact, but none marks
    the end of the stream) is a truncated file, not shorter audio."""
    from polyaccel.asr.audio import AudioError, load_audio, stream_audio

    whole = tmp_path / "whole.ogg"
    t = np.arange(8 * SR) / SR
    sf.write(whole, (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), SR, format="OGG", subtype="VORBIS")
    data = whole.read_bytes()
    assert len(load_audio(whole)) > 7 * SR
    cut = tmp_path / "cut.ogg"
    cut.write_bytes(data[:data.rfind(b"OggS")])  # drop the last page (the one with end-of-stream)
    with pytest.raises(AudioError, match="truncated"):
        load_audio(cut)
    with pytest.raises(AudioError, match="truncated"):
        for _ in stream_audio(cut):
            pass


# ---- the results file --------------------------------------------------------------------------------


def test_resume_drops_duplicate_records_of_one_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A results file holding one input twice (by two spellings of its path, as a Ray retry or
    an older run could leave it) is repaired to its first good record; failed ones go too."""
    from polyaccel.asr.results_file import ResultsWriter, completed, load_results

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out.jsonl"
    recs = [{"path": "a.wav", "text": "first", "duration_s": 1.0, "error": None},
            {"path": "b.wav", "text": "", "duration_s": 0.0, "error": "missing file"},
            {"path": str(tmp_path / "a.wav"), "text": "second", "duration_s": 1.0, "error": None},
            {"path": "b.wav", "text": "bee", "duration_s": 1.0, "error": None},
            {"path": "./b.wav", "text": "bee again", "duration_s": 1.0, "error": None}]
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert [r["text"] for r in completed(recs)] == ["first", "bee"]
    with ResultsWriter(out) as w:
        assert w.done == {"a.wav", "b.wav"}
    assert [r["text"] for r in load_results(out)] == ["first", "bee"]


@pytest.mark.parametrize("torn", [b"{", b'{"pa', b'{"path": ', b'{"path": "b.wav", "te',
                                  b"\0" * 300, b'{"path": "b.wav", "te' + b"\0" * 4000])
def test_a_torn_last_line_of_any_length_is_repaired_not_refused(tmp_path: Path, torn: bytes) -> None:
    """A kill can cut the last line after any byte, even inside ``{"path": ``, and a power loss
    can leave the unwritten end of the file as zero bytes: the file is still ours (no
    NotResultsFile, which would make the CLI refuse to resume) and the repair drops just that
    line."""
    from polyaccel.asr.results_file import ResultsWriter, scan_results

    out = tmp_path / "out.jsonl"
    good = b'{"path": "a.wav", "text": "a", "duration_s": 1.0, "error": null}\n'
    out.write_bytes(good + torn)
    scan = scan_results(out)  # strict, as the CLI reads it
    assert [r["path"] for r in scan.records] == ["a.wav"] and not scan.clean
    with ResultsWriter(out) as w:
        w.write({"path": "b.wav", "text": "b", "duration_s": 1.0, "error": None})
    assert [json.loads(x)["path"] for x in out.read_bytes().splitlines()] == ["a.wav", "b.wav"]


def test_resume_after_a_last_record_without_its_newline_keeps_both_records(tmp_path: Path) -> None:
    """A kill right before the newline leaves a whole record with none after it: appending
    there would join the next record onto its line and lose both. The file is repaired first."""
    from polyaccel.asr.results_file import ResultsWriter, load_results, scan_results

    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"path": "a.wav", "text": "a", "duration_s": 1.0, "error": null}')
    assert not scan_results(out).clean
    with ResultsWriter(out) as w:
        assert w.done == {"a.wav"}
        w.write({"path": "b.wav", "text": "b", "duration_s": 1.0, "error": None})
    assert [r["path"] for r in load_results(out)] == ["a.wav", "b.wav"]
    assert out.read_bytes().count(b"\n") == 2


def test_a_short_write_still_appends_the_whole_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``os.write`` may write fewer bytes than asked: the writer goes on until the line is whole."""
    from polyaccel.asr import results_file
    from polyaccel.asr.results_file import ResultsWriter, load_results

    real = results_file.os.write
    monkeypatch.setattr(results_file.os, "write", lambda fd, data: real(fd, bytes(data[:7])))
    out = tmp_path / "out.jsonl"
    with ResultsWriter(out) as w:
        w.write({"path": "a.wav", "text": "a long enough transcript", "duration_s": 1.0, "error": None})
    assert [r["text"] for r in load_results(out)] == ["a long enough transcript"]


def test_the_writer_fsyncs_on_close_and_once_per_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records a run reported done must survive a power loss: the writer syncs its file at most
    :data:`FSYNC_INTERVAL_S` apart while writing, and always when it closes."""
    import os
    import types

    from polyaccel.asr import results_file
    from polyaccel.asr.results_file import ResultsWriter, load_results

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    clock = [1000.0]
    monkeypatch.setattr(results_file, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    rec = {"path": "a.wav", "text": "a", "duration_s": 1.0, "error": None}
    with ResultsWriter(tmp_path / "out.jsonl") as w:
        fd = w._fd
        w.write(rec)
        assert synced == [], "not within the interval"
        clock[0] += results_file.FSYNC_INTERVAL_S
        w.write({**rec, "path": "b.wav"})
        assert synced == [fd], "an interval after the last sync"
        w.write({**rec, "path": "c.wav"})
        assert synced == [fd]
    assert synced == [fd, fd], "and on close"
    assert [r["path"] for r in load_results(tmp_path / "out.jsonl")] == ["a.wav", "b.wav", "c.wav"]


def test_one_record_per_input_is_its_first_good_one_as_resume_keeps(tmp_path: Path) -> None:
    """An input with two good lines (concatenated results, a Ray retry): export and wer use the
    same record a resumed run kept (the first), not whichever came last."""
    from polyaccel.asr.cli import main
    from polyaccel.asr.results_file import completed, one_per_input

    recs = [{"path": "a.wav", "text": "", "duration_s": 0.0, "error": "boom"},
            {"path": "a.wav", "text": "first", "duration_s": 1.0, "error": None},
            {"path": "b.wav", "text": "bee", "duration_s": 1.0, "error": None},
            {"path": "a.wav", "text": "second", "duration_s": 1.0, "error": None},
            {"path": "a.wav", "text": "", "duration_s": 0.0, "error": "late failure"}]
    assert [r["text"] for r in one_per_input(recs)] == ["first", "bee"]
    assert [r["text"] for r in completed(recs)] == ["first", "bee"]
    res = tmp_path / "out.jsonl"
    res.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["export", str(res), "-f", "txt", "-d", str(tmp_path / "t"), "-q"]) == 0
    assert (tmp_path / "t" / "a.txt").read_text() == "first\n"


def test_a_lock_file_removed_while_it_is_being_locked_is_made_again(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The run holding the lock releases it (unlinks the file) between our open and our flock:
    our flock then succeeds on a file no longer in the folder, which a third run would not see.
    The lock is taken again on a new file, so two runs never write one output."""
    import fcntl
    import os

    from polyaccel.asr.results_file import OutputBusy, OutputLock

    out = tmp_path / "out.jsonl"
    real_flock = fcntl.flock
    calls: list[int] = []

    def flock(fd: int, op: int) -> None:
        if not calls:
            os.unlink(tmp_path / "out.jsonl.polyaccel-asr.lock")  # the holder's release, just before our flock
        calls.append(fd)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    with OutputLock(out) as lock:
        monkeypatch.setattr(fcntl, "flock", real_flock)
        assert len(calls) == 2, "the first, unlinked file was let go and a new one locked"
        assert os.path.samestat(os.fstat(lock._fd), os.stat(lock.path))
        with pytest.raises(OutputBusy):
            OutputLock(out).acquire()
    assert not lock.path.exists()


# ---- timestamps: seeking past the last segment ---------------------------------------------------


def _timed_first_8s(batch: list[np.ndarray]) -> list[TimedText]:
    """Says the words of the first 8 s only, one segment each, in seconds from the audio's start."""
    out = []
    for a in batch:
        runs = [(s, e, k) for s, e, k in _runs(a) if e <= 8 * SR]
        out.append(TimedText(" ".join(f"w{k}" for *_, k in runs),
                             [Segment(round(s / SR, 2), round(e / SR, 2), f"w{k}") for s, e, k in runs]))
    return out


def test_decode_tail_seeks_three_times_with_absolute_times() -> None:
    """A window whose decoding stops after 8 s of its 29.7 s is decoded again from its last
    segment's end, up to three times: every word comes back once, each segment where its word is."""
    from polyaccel.asr.timestamps import decode_tail

    n = 56
    audio = _spoken(n)
    (first,) = _timed_first_8s([audio])
    out = decode_tail(audio, first, _timed_first_8s, SR)
    assert str(out) == " ".join(f"w{k}" for k in range(n))
    assert [s.text for s in out.segments] == [f"w{k}" for k in range(n)]
    for k, s in enumerate(out.segments):
        assert s.start == pytest.approx(k * PERIOD_S + GAP_S, abs=0.02), (k, s)
        assert s.end == pytest.approx((k + 1) * PERIOD_S, abs=0.02), (k, s)


# ---- subtitles ------------------------------------------------------------------------------------


def test_subtitle_clock_past_a_day_and_cues_never_end_before_they_start() -> None:
    """Hours keep counting past 24 (a 25 h recording's cue is not at 01:00:00), and a segment
    whose end is before its start (a malformed or hand-edited record) ends no earlier than it
    starts: the shortest cue's half second after it (a zero-length cue is never shown)."""
    from polyaccel.asr.export import to_srt, to_vtt

    segs = [{"start": 90000.25, "end": 90001.5, "text": "late"}, {"start": 5.0, "end": 4.0, "text": "back"}]
    assert to_srt(segs) == ("1\n25:00:00,250 --> 25:00:01,500\nlate\n\n"
                            "2\n00:00:05,000 --> 00:00:05,500\nback\n\n")
    assert to_vtt(segs) == ("WEBVTT\n\n25:00:00.250 --> 25:00:01.500\nlate\n\n"
                            "00:00:05.000 --> 00:00:05.500\nback\n\n")


def test_export_takes_the_good_record_after_a_failed_one(tmp_path: Path) -> None:
    """A resumed results file holds an input's failed line and, later, its good one: the
    subtitle is written from the good one and the export succeeds."""
    from polyaccel.asr.cli import main

    res = tmp_path / "out.jsonl"
    recs = [{"path": "a.wav", "text": "", "duration_s": 0.0, "error": "recognition failed: boom"},
            {"path": "a.wav", "text": "hi", "duration_s": 1.0, "error": None,
             "segments": [{"start": 0.0, "end": 1.0, "text": "hi"}]}]
    res.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "subs"
    assert main(["export", str(res), "-f", "srt", "-d", str(out), "-q"]) == 0
    assert (out / "a.srt").read_text() == "1\n00:00:00,000 --> 00:00:01,000\nhi\n\n"


@pytest.mark.parametrize("link", ["hard link", "symlink"])
def test_export_overwrite_replaces_the_file_not_what_it_links_to(tmp_path: Path, link: str) -> None:
    """``--overwrite`` puts a new file in place of ``-d``'s old one (written beside it and renamed
    over it). Writing into the old one instead would change a user's file that the old one is
    a hard or symbolic link to, and a kill mid-write would leave a half-written subtitle."""
    import os

    from polyaccel.asr.cli import main

    res = tmp_path / "out.jsonl"
    res.write_text(json.dumps({"path": "clips/a.wav", "text": "new words", "duration_s": 1.0, "error": None}) + "\n")
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    subs = tmp_path / "subs"
    subs.mkdir()
    if link == "hard link":
        os.link(mine, subs / "a.txt")
    else:
        (subs / "a.txt").symlink_to(mine)
    assert main(["export", str(res), "-f", "txt", "-d", str(subs), "-q"]) == 3  # exists: left alone
    assert mine.read_text() == "my notes\n"
    assert main(["export", str(res), "-f", "txt", "-d", str(subs), "--overwrite", "-q"]) == 0
    assert mine.read_text() == "my notes\n"
    assert not (subs / "a.txt").is_symlink() and (subs / "a.txt").read_text() == "new words\n"
    assert sorted(p.name for p in subs.iterdir()) == ["a.txt"], "no temporary left behind"


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_export_file_cut_short_by_a_write_error_is_not_left_behind(tmp_path: Path, overwrite: bool,
                                                                       capsys: pytest.CaptureFixture) -> None:
    """A write that fails half-way (a full disk; here the file size limit) must not leave a
    half-written subtitle: a rerun without --overwrite would take it for a finished one
    ("exists") and keep it for good; with --overwrite the file it replaces stays whole. No
    partial or temporary file is left, and the rerun writes the whole file."""
    import resource

    from polyaccel.asr.cli import main

    text = "word " * 4000
    res = tmp_path / "out.jsonl"
    res.write_text(json.dumps({"path": "a.wav", "text": text, "duration_s": 1.0, "error": None}) + "\n")
    subs = tmp_path / "subs"
    subs.mkdir()
    extra = ["--overwrite"] if overwrite else []
    if overwrite:
        (subs / "a.txt").write_text("old words\n")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # writes past 4 kB fail (EFBIG)
    try:
        status = main(["export", str(res), "-f", "txt", "-d", str(subs), "-q", *extra])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert status == 3 and "cannot write" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in subs.iterdir()} == ({"a.txt": "old words\n"} if overwrite else {})
    assert main(["export", str(res), "-f", "txt", "-d", str(subs), "-q", *extra]) == 0
    assert [p.name for p in subs.iterdir() if ".bak-" not in p.name] == ["a.txt"]
    # "old words" was not written by export: --overwrite keeps it aside (test_redteam_s33_export_keeps_user_files)
    assert [p.read_text() for p in subs.glob("a.txt.bak-*")] == (["old words\n"] if overwrite else [])
    assert (subs / "a.txt").read_text() == text.strip() + "\n"


# ---- greedy decoding ------------------------------------------------------------------------------


def test_begin_suppress_applies_at_the_first_generated_step_only() -> None:
    """Hugging Face's ``begin_suppress_tokens`` (Whisper: the space and ``eos``): never the first
    generated token, allowed after it; ``suppress_tokens`` never."""
    import torch

    from polyaccel.asr.decoding import LogitsRules, greedy_decode

    V, eos = 8, 3

    def step(tokens, position):  # always: eos > 0 > 6 (suppressed) > 5
        logits = torch.zeros(tokens.shape[0], V)
        logits[:, eos], logits[:, 0], logits[:, 6], logits[:, 5] = 9.0, 8.0, 7.0, 6.0
        return logits

    kw = dict(batch=2, num_real=1, prompt=[1, 2], eos_id=eos, max_new_tokens=4, device="cpu", check_every=1)
    (h,) = greedy_decode(step, rules=LogitsRules([6], [eos, 0]), **kw)
    assert h.tokens == [5]  # the first token skips eos and 0 (and 6); then eos ends it
    (h,) = greedy_decode(step, rules=LogitsRules([6, eos], [0]), **kw)
    assert h.tokens == [5, 0, 0, 0]  # eos suppressed throughout: runs to max_new_tokens


# ---- WER and references ----------------------------------------------------------------------------


def test_wer_counts_every_word_said_over_an_empty_reference() -> None:
    """An utterance whose reference is empty (silence) adds its words as insertions."""
    from polyaccel.asr.wer import wer, wer_counts

    c = wer_counts(["", "a b c d"], ["uh well hello", "a b c d"])  # "uh" is a filler, normalized away
    assert (c.substitutions, c.deletions, c.insertions, c.ref_words) == (0, 0, 2, 4)
    assert c.wer == pytest.approx(0.5)
    assert wer([""], ["hello"]) == float("inf")


def test_references_match_by_full_path_before_file_name(tmp_path: Path) -> None:
    """Two inputs with one file name in different folders get their own references; a bare
    utterance id is not replaced by a later path line with the same file name."""
    from polyaccel.asr.manifest import InputItem, attach_refs, read_refs

    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "c", "text": "by id"},
        {"path": "/d1/a.wav", "text": "first"},
        {"path": "/d2/a.wav", "text": "second"},
        {"path": "/d3/c.wav", "text": "another c"},
    ]))
    items = [InputItem("/d2/a.wav"), InputItem("/d1/a.wav"), InputItem("/elsewhere/a.wav"), InputItem("/d4/c.wav"),
             InputItem("/d3/c.wav")]
    attach_refs(items, read_refs(refs))
    assert [it.ref for it in items] == ["second", "first", "first", "by id", "another c"]


def test_greedy_stops_once_every_row_has_ended() -> None:
    """Rows that end early stop the loop at the next check (a batch is not decoded to
    ``max_new_tokens`` when every row said ``eos``): the decoder step runs only that often."""
    import torch

    from polyaccel.asr.decoding import LogitsRules, greedy_decode

    V, eos, calls = 6, 3, []

    def step(tokens, position):
        calls.append(int(position[0]))
        logits = torch.zeros(tokens.shape[0], V)
        logits[:, 4] = 1.0
        logits[:, eos] = 2.0 * (position >= 3).float()  # eos from the third generated token on
        return logits

    hyps = greedy_decode(step, batch=4, num_real=3, prompt=[0, 1], eos_id=eos, max_new_tokens=100,
                         rules=LogitsRules([], []), device="cpu", check_every=4)
    assert [h.tokens for h in hyps] == [[4, 4]] * 3
    # one prompt step, generated steps up to the first check, and the one queued before it is read
    assert len(calls) == 1 + 4 + 1
    every_step = greedy_decode(step, batch=4, num_real=3, prompt=[0, 1], eos_id=eos, max_new_tokens=100,
                               rules=LogitsRules([], []), device="cpu", check_every=1)
    assert [(h.tokens, h.avg_logprob) for h in every_step] == [(h.tokens, h.avg_logprob) for h in hyps]


def test_a_failed_later_window_fails_the_whole_file() -> None:
    """When recognition fails for the second window of a long file only, the file is an error
    (retried by a rerun), never a transcript missing that window's words."""
    def recognize(batch: list[np.ndarray]) -> list[str]:
        if any(a[0] != 0 for a in batch):  # the second window starts inside a word
            raise RuntimeError("device lost")
        return [" ".join(f"w{k}" for *_, k in _runs(a)) for a in batch]

    with Transcriber(lambda i: recognize, sample_rate=SR, replicas=1, batch_size=1) as tr:
        r, short = tr.transcribe([_spoken(95), _spoken(5)])
    assert r.windows == 2 and r.text == ""
    assert r.error is not None and "device lost" in r.error
    assert short.ok and short.text == "w0 w1 w2 w3 w4"


@pytest.mark.parametrize("where", ["opening", "streaming"])
def test_an_unexpected_read_error_is_that_files_error_not_the_jobs(tmp_path: Path, where: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that is not an AudioError (a file the user may not read: PermissionError) while
    one file is opened, or half-way through streaming a long one, fails that file only; the
    files around it keep their transcripts (the job would otherwise end and lose them)."""
    import soundfile as sf

    from polyaccel.asr import transcriber as transcriber_mod

    paths = []
    for name, seconds in (("a.wav", 1.0), ("locked.wav", 45.0 if where == "streaming" else 1.0), ("c.wav", 2.0)):
        sf.write(tmp_path / name, np.full(int(seconds * SR), 0.1, np.float32), SR)
        paths.append(str(tmp_path / name))
    real_extent, real_stream = transcriber_mod.audio_extent, transcriber_mod.stream_audio

    def extent(path, *a, **k):
        if where == "opening" and path.endswith("locked.wav"):
            raise PermissionError(13, "Permission denied")
        return real_extent(path, *a, **k)

    def stream(path, *a, **k):
        for i, block in enumerate(real_stream(path, *a, **k)):
            if i == 1:
                raise PermissionError(13, "Permission denied")
            yield block

    monkeypatch.setattr(transcriber_mod, "audio_extent", extent)
    monkeypatch.setattr(transcriber_mod, "stream_audio", stream)
    with Transcriber(lambda i: lambda batch: [f"{len(a)} samples" for a in batch], sample_rate=SR,
                     replicas=1, batch_size=2) as tr:
        a, locked, c = tr.transcribe(paths)
    assert (a.text, a.error, c.text, c.error) == (f"{SR} samples", None, f"{2 * SR} samples", None)
    assert locked.text == "" and locked.error == "permission denied: the file may not be read"  # audit-asr: was "could not read: PermissionError: [Errno 13] ..."


# ---- the CLI: exit status after resumes and write errors ---------------------------------------------


@pytest.fixture
def fake_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """``transcribe`` with a recognizer that says how many samples it got (no model load)."""
    def from_pretrained(path_or_name="fake", *, batch_size=None, replicas=None, **kw):
        return Transcriber(lambda i: lambda batch: [f"{len(a)} samples" for a in batch], sample_rate=SR,
                           max_audio_seconds=30.0, replicas=replicas or 1, batch_size=batch_size or 8,
                           model_name=str(path_or_name))

    monkeypatch.setattr(Transcriber, "from_pretrained", staticmethod(from_pretrained))


def test_a_rerun_whose_retries_fail_again_exits_1_not_3(asr_cli, fake_model: None, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """Exit 3 means nothing was ever transcribed; a rerun where only the retried file fails
    again, the others done before, is 1 (some failed)."""
    from polyaccel.asr.cli import main

    args = ["transcribe", str(asr_cli.wav(tmp_path / "a.wav", 0.5)), str(tmp_path / "late.wav"),
            "-o", str(tmp_path / "o.jsonl"), "-q"]
    assert main(args) == 1
    assert main(args) == 1
    assert "0 ok, 1 failed, 1 skipped" in capsys.readouterr().err
    (tmp_path / "notes.wav").write_text("not audio")
    assert main(["transcribe", str(tmp_path / "notes.wav"), "-o", str(tmp_path / "p.jsonl"), "-q"]) == 3


def test_a_write_error_mid_run_is_exit_1_and_the_rerun_finishes(asr_cli, fake_model: None, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture) -> None:
    """The disk fills after the first record: the run says so and exits 1 (never 0 with
    records missing); a rerun resumes and writes the rest."""
    import errno

    from polyaccel.asr.cli import main
    from polyaccel.asr.results_file import ResultsWriter

    wavs = [str(asr_cli.wav(tmp_path / f"c{i}.wav", 0.1 * (i + 1))) for i in range(3)]
    out = tmp_path / "o.jsonl"
    real = ResultsWriter.write
    written: list[str] = []

    def full_after_one(self, record):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(record["path"])
        real(self, record)

    monkeypatch.setattr(ResultsWriter, "write", full_after_one)
    assert main(["transcribe", *wavs, "-o", str(out), "-q"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert [json.loads(x)["path"] for x in out.read_text().splitlines()] == wavs[:1]
    monkeypatch.setattr(ResultsWriter, "write", real)
    assert main(["transcribe", *wavs, "-o", str(out), "-q"]) == 0
    assert sorted(json.loads(x)["path"] for x in out.read_text().splitlines()) == sorted(wavs)


def test_a_full_disk_at_the_first_write_leaves_no_empty_output_nor_its_folders(
        asr_cli, fake_model: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    """Nothing written: the -o file this run created and the folders it made for it go again
    (an existing empty -o stays)."""
    import errno

    from polyaccel.asr.cli import main
    from polyaccel.asr.results_file import ResultsWriter

    def full(self, record):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ResultsWriter, "write", full)
    wav = str(asr_cli.wav(tmp_path / "a.wav", 0.1))
    assert main(["transcribe", wav, "-o", str(tmp_path / "d1" / "d2" / "x.jsonl"), "-q"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"]
    mine = tmp_path / "mine.jsonl"
    mine.write_text("")
    assert main(["transcribe", wav, "-o", str(mine), "-q"]) == 1
    assert mine.exists() and mine.read_text() == ""
