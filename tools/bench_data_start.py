"""How long a process takes to open the token cache of an unchanged data file: a synthetic
pre-tokenized JSONL file is written (once) and cached by a first process, then each of
``--runs`` fresh processes times ``build_dataset`` on it (what every rank and resume does at
start; Transformers is imported first, as in a training process). One JSON line per run; the
data stays in the page cache between runs, or with ``--cold`` is dropped from it before each
(``POSIX_FADV_DONTNEED`` on the data and cache files only: each run reads from the disk).

    python tools/bench_data_start.py --dir /tmp/bench               # 700 MB of data
    python tools/bench_data_start.py --dir /tmp/bench --size-mb 200 --runs 5 --cold

Run it under each version to compare (its ``--dir`` cache is per version: use another one).
A ``data.jsonl`` already in ``--dir`` is used when it holds ``--size-mb`` MB, else refused (exit
2), never replaced: it may be your own data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VOCAB, SEQ_LEN = 32000, 2048

_OPEN = f"""
import json, sys, time
import tokenizers, transformers  # imported by a training process before its data (timed apart)
from polyaccel.moe.data import build_dataset
from polyaccel.moe.train_config import DataConfig
t0 = time.perf_counter()
ds = build_dataset(DataConfig(jsonl=sys.argv[1]), seq_len={SEQ_LEN}, vocab_size={VOCAB}, cache_dir=sys.argv[2])
print(json.dumps({{"seconds": round(time.perf_counter() - t0, 3), "samples": len(ds)}}))
"""


def write_data(path: Path, size_mb: int) -> None:
    """Records of 512 random token ids until ``path`` holds ``size_mb`` MB (kept when it does).
    An existing smaller ``path`` is never replaced (it may be the user's data): exit 2."""
    if os.path.lexists(path):
        if path.is_file() and path.stat().st_size >= size_mb << 20:
            return
        print(f"bench_data_start.py: error: {path} exists and is not a file of at least {size_mb} MB: not "
              "replaced (it may be your data); remove it or choose another --dir", file=sys.stderr)
        raise SystemExit(2)
    rng = np.random.default_rng(0)
    fd, name = tempfile.mkstemp(prefix=".data-", suffix=".tmp", dir=path.parent)  # never a file of the user's
    try:
        with os.fdopen(fd, "w") as f:
            while f.tell() < size_mb << 20:
                block = rng.integers(0, VOCAB, size=(256, 512))
                f.write("".join('{"input_ids": [' + ", ".join(map(str, row)) + "]}\n" for row in block.tolist()))
        os.link(name, path)  # fails where a file appeared there meanwhile, instead of replacing it
    finally:
        os.unlink(name)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the cached pages of ``paths`` (written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def open_once(data: Path, cache: Path) -> dict:
    """One fresh process's ``build_dataset`` on ``data`` with its cache in ``cache``."""
    out = subprocess.run([sys.executable, "-c", _OPEN, str(data), str(cache)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the data file and its cache go")
    ap.add_argument("--size-mb", type=int, default=700)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache before each run")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    data, cache = args.dir / "data.jsonl", args.dir / "cache"
    write_data(data, args.size_mb)
    time.sleep(2.5)  # a data file changed within the last 2 s is hashed at each start: let it settle
    first = open_once(data, cache)  # builds the cache where this version has none
    print(json.dumps({"run": "first", "data_mb": data.stat().st_size >> 20, **first}), flush=True)
    for i in range(args.runs):
        if args.cold:
            drop_from_page_cache([data, *(p for p in cache.rglob("*") if p.is_file())])
        print(json.dumps({"run": i + 1, "cold": args.cold, **open_once(data, cache)}), flush=True)


if __name__ == "__main__":
    main()
