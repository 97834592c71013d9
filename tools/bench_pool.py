"""ReplicaPool's own overhead per item: a replica that does nothing, ``map()`` and ``submit()``
at several batch sizes, in a process that holds torch (its ~400k objects are what the garbage
collector walks). One JSON line per row.

    python tools/bench_pool.py                      # 20,000 items, replicas 2, batch 1 and 64
    python tools/bench_pool.py --items 5000 --batch-sizes 1,8 --replicas 1
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch  # noqa: F401  (the objects a real process holds)

from polyaccel.core.runtime import ReplicaPool


class NoOp:
    """A replica whose work is nothing: what is left is the pool's."""

    def __init__(self, index: int) -> None:
        self.index = index

    def process(self, batch: list) -> list:
        return batch


def time_pool(items: int, replicas: int, batch_size: int, how: str) -> float:
    """Seconds per item through ``how`` (``map`` or ``submit``)."""
    with ReplicaPool(NoOp, replicas, batch_size=batch_size, queue_capacity=4096) as pool:
        t0 = time.perf_counter()
        if how == "map":
            n = sum(1 for r in pool.map(range(items)) if r.ok)
        else:
            n = sum(1 for f in [pool.submit(i) for i in range(items)] if f.result().ok)
        elapsed = time.perf_counter() - t0
    assert n == items, (n, items)
    return elapsed / items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=20_000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--repeat", type=int, default=3, help="runs per row; the median is reported")
    args = p.parse_args(argv)
    if args.items < 1 or args.replicas < 1 or args.repeat < 1:
        p.error("--items, --replicas and --repeat must be >= 1")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes: not a list of whole numbers: {args.batch_sizes!r}")
    if any(b < 1 for b in sizes):
        p.error("--batch-sizes must be >= 1")
    for how in ("map", "submit"):
        for b in sizes:
            runs = sorted(time_pool(args.items, args.replicas, b, how) for _ in range(args.repeat))
            print(json.dumps({"api": how, "batch_size": b, "replicas": args.replicas, "items": args.items,
                              "us_per_item": round(runs[len(runs) // 2] * 1e6, 2),
                              "python": platform.python_version()}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
