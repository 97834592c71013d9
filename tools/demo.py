"""`make demo`: transcribe the five LibriVox clips of pocketsphinx-testdata with Whisper tiny.en on
the CPU backend, through a Ray Data job on a local in-process Ray cluster, and score them.

Prints each clip's transcript beside its reference, the corpus WER (both sides normalized) and
the throughput: RTFx inside the actor (decoding, features, encoder and decoder: the pipeline)
and end to end (including starting Ray and loading the model).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--cpus", type=int, default=min(4, os.cpu_count() or 1), help="CPUs of the local Ray cluster")
    p.add_argument("--clips", type=Path, default=LIBRIVOX, help="folder with *.wav and a Sphinx 'transcription'")
    args = p.parse_args()

    clips = sorted(args.clips.glob("*.wav"))
    if not clips or not (args.clips / "transcription").is_file():
        print(f"no LibriVox clips in {args.clips}: apt-get install pocketsphinx-testdata", file=sys.stderr)
        return 1
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, in-process cluster
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    from polyaccel.asr.manifest import InputItem, read_refs
    from polyaccel.asr.ray_job import RayJobOptions, transcribe_with_ray
    from polyaccel.asr.wer import wer_counts

    refs = read_refs(args.clips / "transcription")
    items = [InputItem(str(c), refs.get(c.stem)) for c in clips]
    start = time.perf_counter()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    try:
        opts = RayJobOptions(model=args.model, backend="cpu", batch_size=len(items), num_actors=1)
        records = list(transcribe_with_ray(items, opts))
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
