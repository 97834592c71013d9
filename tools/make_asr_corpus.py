"""Build a reproducible real-length speech corpus for end-to-end ASR benchmarks.

The source is the five real LibriVox clips (16 kHz mono, 3.0-7.1 s, with transcripts) that
the tests use: where ``polyaccel.asr.samples`` finds them (``make setup`` unpacks them from
PocketSphinx's pinned PyPI release), else Debian's ``pocketsphinx-testdata``
(``/usr/share/pocketsphinx/test/data/librivox``), or ``--src``.
Each corpus file is made deterministically from ``(--seed, file index)``:

- ``--files`` clips of 1-35 s: whole source clips joined with 0.15-0.6 s of silence (never
  the same clip twice in a row) until the drawn duration is reached (most files 3-15 s, a quarter 15-35 s); their reference is
  the clips' transcripts joined. About 8% are 1-3 s cuts of one clip's start (at its
  quietest 20 ms frame): real short audio, but with no exact transcript, so they have no
  reference and WER leaves them out.
- ``--long`` files of ``--long-s`` seconds (default 3 x 10 minutes), made the same way.
- a random gain (-12..0 dB), sample rate (8 / 16 / 22.05 / 44.1 / 48 kHz), one or two
  channels and format: WAV 16-bit, WAV float, FLAC, and, where the installed libsndfile
  writes them, Ogg Vorbis and MP3.

Writes ``DIR/audio/NNNN.<ext>``, ``DIR/refs.jsonl`` (``{"id", "text"}`` per file with a
reference: ``polyaccel-asr transcribe DIR/audio --refs DIR/refs.jsonl`` matches them by
file name), ``DIR/manifest.jsonl`` (path, duration, rate, channels, format, ref) and
``DIR/corpus.json`` (the settings and totals). The same seed gives the same refs and
manifest on any machine; the audio is identical for the same numpy, soxr and libsndfile
versions (byte for byte, except that libsndfile gives each Ogg stream a random serial number). Needs numpy, soundfile and soxr (all dependencies of polyaccel-asr).

    python tools/make_asr_corpus.py /tmp/corpus                 # 500 + 3 long files, < 1 minute
    python tools/make_asr_corpus.py /tmp/small --files 20 --long 0 --seed 1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import stat
import sys
import time
from pathlib import Path

import numpy as np

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")


def default_source() -> Path:
    """Where the clips are: polyaccel.asr.samples' folder when it has them, else Debian's."""
    try:
        from polyaccel.asr.samples import librivox_dir
    except ImportError:
        return LIBRIVOX
    return librivox_dir() or LIBRIVOX

SOURCE_RATE = 16000
RATES = (8000, 16000, 22050, 44100, 48000)
# (name, extension, soundfile format, subtype); the last two only where libsndfile writes them
FORMATS = (("wav16", "wav", "WAV", "PCM_16"), ("wavf32", "wav", "WAV", "FLOAT"),
           ("flac", "flac", "FLAC", "PCM_16"), ("ogg", "ogg", "OGG", "VORBIS"),
           ("mp3", "mp3", "MP3", "MPEG_LAYER_III"))
SHORT_SHARE = 0.08


@dataclasses.dataclass(frozen=True, slots=True)
class Clip:
    """One source utterance: its id, 16 kHz mono float32 samples and transcript."""

    id: str
    audio: np.ndarray
    text: str


def read_sources(src: Path) -> list[Clip]:
    """The clips listed in ``src/transcription`` (Sphinx lines), sorted by id."""
    import soundfile as sf

    trans = src / "transcription"
    if not trans.is_file():
        raise SystemExit(f"{trans} not found: install Debian's pocketsphinx-testdata or pass --src")
    clips = []
    for line in trans.read_text().splitlines():
        m = re.match(r"<s>(.*)</s>\s*\((\S+)\)", line.strip())
        if not m:
            continue
        audio, rate = sf.read(src / f"{m.group(2)}.wav", dtype="float32")
        if rate != SOURCE_RATE or audio.ndim != 1:
            raise SystemExit(f"{m.group(2)}.wav: expected 16 kHz mono, got {rate} Hz, shape {audio.shape}")
        clips.append(Clip(m.group(2), audio, " ".join(m.group(1).split())))
    if not clips:
        raise SystemExit(f"no clips in {trans}")
    return sorted(clips, key=lambda c: c.id)


def writable_formats() -> list[tuple[str, str, str, str]]:
    """The entries of FORMATS the installed libsndfile can write."""
    import soundfile as sf

    return [f for f in FORMATS if f[2] in sf.available_formats() and f[3] in sf.available_subtypes(f[2])]


def draw_duration(rng: np.random.Generator) -> float:
    """A clip length in seconds: 8% 1-3 s, 67% 3-15 s, 25% 15-35 s."""
    u = rng.random()
    if u < SHORT_SHARE:
        return float(rng.uniform(1.0, 3.0))
    if u < 0.75:
        return float(rng.uniform(3.0, 15.0))
    return float(rng.uniform(15.0, 35.0))


def join_clips(clips: list[Clip], target_s: float, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """Whole clips separated by short silences, until ``target_s`` would be passed (at least one);
    never the same clip twice in a row (one sentence said over and over sends greedy Whisper into
    a repetition loop, which real speech seldom does)."""
    parts: list[np.ndarray] = []
    words: list[str] = []
    total = 0
    limit = int(target_s * SOURCE_RATE)
    last = -1
    while True:
        choices = [i for i in range(len(clips)) if i != last]
        last = choices[int(rng.integers(len(choices)))]
        clip = clips[last]
        gap = np.zeros(int(rng.uniform(0.15, 0.6) * SOURCE_RATE), np.float32)
        if parts and total + len(gap) + len(clip.audio) > limit:
            break
        if parts:
            parts.append(gap)
            total += len(gap)
        parts.append(clip.audio)
        words.append(clip.text)
        total += len(clip.audio)
    return np.concatenate(parts), " ".join(words)


def short_cut(clips: list[Clip], target_s: float, rng: np.random.Generator) -> np.ndarray:
    """The start of one clip, cut at its quietest 20 ms frame between 1 s and ``target_s``."""
    clip = clips[int(rng.integers(len(clips)))]
    frame = SOURCE_RATE // 50
    lo, hi = SOURCE_RATE // frame, max(SOURCE_RATE // frame + 1, int(target_s * SOURCE_RATE) // frame)
    hi = min(hi, len(clip.audio) // frame)
    energy = [float(np.square(clip.audio[i * frame:(i + 1) * frame]).sum()) for i in range(lo, hi)]
    cut = (lo + int(np.argmin(energy)) + 1) * frame
    return clip.audio[:cut].copy()


def render(audio: np.ndarray, rng: np.random.Generator, formats: list[tuple[str, str, str, str]]
           ) -> tuple[np.ndarray, int, int, tuple[str, str, str, str]]:
    """Gain, sample rate, channels and format for one file: (samples [T] or [T, 2], rate, channels, format)."""
    import soxr

    gain = float(10 ** (rng.uniform(-12.0, 0.0) / 20))
    peak = float(np.abs(audio).max()) or 1.0
    audio = audio * min(gain, 0.95 / peak)
    rate = RATES[int(rng.integers(len(RATES)))]
    channels = 2 if rng.random() < 0.2 else 1
    fmt = formats[int(rng.integers(len(formats)))]
    if rate != SOURCE_RATE:
        audio = soxr.resample(audio, SOURCE_RATE, rate, quality="HQ")
    audio = np.clip(audio, -1.0, 1.0).astype(np.float32)
    if channels == 2:  # a slightly quieter right channel: the mono mix differs from either side
        audio = np.stack([audio, 0.8 * audio], axis=1)
    return audio, rate, channels, fmt


WRITE_BLOCK = 1 << 16  # frames per libsndfile write


def make_file(index: int, seed: int, clips: list[Clip], out: Path, formats: list[tuple[str, str, str, str]],
              long_s: float | None) -> dict:
    """Write corpus file ``index``; returns its manifest record."""
    import soundfile as sf

    rng = np.random.default_rng([seed, index])
    target = long_s if long_s is not None else draw_duration(rng)
    ref: str | None
    if long_s is None and target < 3.0:
        audio, ref = short_cut(clips, target, rng), None
    else:
        audio, ref = join_clips(clips, target, rng)
    duration = len(audio) / SOURCE_RATE
    data, rate, channels, (name, ext, major, subtype) = render(audio, rng, formats)
    path = out / "audio" / f"{index:04d}.{ext}"
    with sf.SoundFile(path, "w", rate, channels, format=major, subtype=subtype) as f:
        for start in range(0, len(data), WRITE_BLOCK):  # one 10-minute Vorbis write crashes libsndfile
            f.write(data[start:start + WRITE_BLOCK])
    return {"id": path.stem, "path": f"audio/{path.name}", "duration_s": round(duration, 3), "sample_rate": rate,
            "channels": channels, "format": name, "text": ref}


_OURS = re.compile(r"\d{4,}\.(wav|flac|ogg|mp3|m4a|opus|webm)")
_WRITTEN = ("corpus.json", "manifest.jsonl", "refs.jsonl", "audio")


def _unsafe(path: Path) -> str | None:
    """Why writing in or through ``path`` could reach another user's files (None if safe): a
    link (written through), or a file or folder that another user owns or may write in (such
    as a folder left in a shared ``/tmp``, where links can be put in after the checks)."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != os.getuid():
        return "belongs to another user"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return "is writable by every user"
    return None


def _check_safe(out: Path) -> None:
    """Refuse an ``out`` where writing could reach another user's files (:func:`_unsafe`)."""
    for path in [out.resolve(), *(out / name for name in _WRITTEN), *(out / "audio").glob("*")]:
        why = _unsafe(path) if os.path.lexists(path) else None
        if why:
            raise SystemExit(f"{path} {why}: the corpus is not written there; choose a new or empty folder")


def _check_out(out: Path) -> None:
    """Refuse an ``out`` that holds anything but a corpus this tool wrote (its files are
    replaced on a rebuild): a user's folder, or its ``audio/``, is never emptied. Nothing is
    written through a link or into a folder another user controls."""
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"{out} exists and is not a folder")
    _check_safe(out)
    others = sorted(p.name for p in out.iterdir() if p.name not in _WRITTEN)
    if others or (any(out.iterdir()) and not (out / "corpus.json").is_file()):
        raise SystemExit(f"{out} is not a corpus this tool wrote ({', '.join(others[:5]) or 'no corpus.json'}); "
                         "choose a new or empty folder")
    audio = out / "audio"
    foreign = sorted(p.name for p in audio.iterdir() if not _OURS.fullmatch(p.name)) if audio.is_dir() else []
    if foreign:
        raise SystemExit(f"{audio} holds files this tool did not write ({', '.join(foreign[:5])}); "
                         "choose a new or empty folder")


def build(out: Path, *, files: int, long: int, long_s: float, seed: int, src: Path,
          workers: int | None = None) -> dict:
    """Write the whole corpus into ``out`` and return its summary (also ``out/corpus.json``)."""
    start = time.perf_counter()
    clips = read_sources(src)
    formats = writable_formats()
    _check_out(out)
    (out / "audio").mkdir(parents=True, exist_ok=True)
    _check_safe(out)  # again: another user may have made the folder between the check and mkdir
    for old in (out / "audio").iterdir():  # a rebuild never mixes in files of another seed
        if old.is_file() and _OURS.fullmatch(old.name):
            old.unlink()
    jobs = [(i, None) for i in range(files)] + [(files + k, long_s) for k in range(long)]
    workers = workers or min(len(jobs), os.cpu_count() or 1) or 1
    if workers > 1:
        with concurrent.futures.ProcessPoolExecutor(workers) as ex:
            records = list(ex.map(make_file, [i for i, _ in jobs], [seed] * len(jobs), [clips] * len(jobs),
                                  [out] * len(jobs), [formats] * len(jobs), [s for _, s in jobs],
                                  chunksize=8))
    else:
        records = [make_file(i, seed, clips, out, formats, s) for i, s in jobs]
    with open(out / "manifest.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({"audio_filepath": r["path"], **r}) + "\n")
    with open(out / "refs.jsonl", "w") as f:
        for r in records:
            if r["text"] is not None:
                f.write(json.dumps({"id": r["id"], "text": r["text"]}) + "\n")
    summary = {"seed": seed, "files": len(records), "long_files": long, "long_s": long_s,
               "audio_s": round(sum(r["duration_s"] for r in records), 2),
               "with_ref": sum(r["text"] is not None for r in records),
               "formats": sorted({r["format"] for r in records}),
               "sample_rates": sorted({r["sample_rate"] for r in records}),
               "sources": [c.id for c in clips], "build_s": round(time.perf_counter() - start, 2)}
    (out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="output directory: new, empty, or a corpus this tool wrote (replaced)")
    p.add_argument("--files", type=int, default=500, help="files of 1-35 s")
    p.add_argument("--long", type=int, default=3, help="long files")
    p.add_argument("--long-s", type=float, default=600.0, help="length of each long file (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--src", type=Path, default=None, help="folder with the clips and 'transcription'")
    p.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    args = p.parse_args(argv)
    print(json.dumps(build(args.out, files=args.files, long=args.long, long_s=args.long_s, seed=args.seed,
                           src=args.src or default_source(), workers=args.workers)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
