"""The weight-gradient autotuner's prune (CPU): skinny outputs (LoRA adapters' gradients)
try only the skinny tiles, other outputs only the others, and nothing is ever pruned away."""

from __future__ import annotations

import types

from polyaccel.cuda import grouped_wgrad


def _configs():
    return [types.SimpleNamespace(kwargs={"BLOCK_N": bn, "BLOCK_K": bk}) for bn, bk, *_ in grouped_wgrad.CONFIGS]


def test_skinny_outputs_try_only_skinny_tiles_and_others_only_the_rest():
    configs = _configs()
    for n, k in ((2048, 16), (16, 2048), (1536, 64)):
        kept = grouped_wgrad._prune(configs, {"N": n, "K": k})
        assert kept and all(min(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) <= 32 for c in kept), (n, k)
    for n, k in ((1536, 2048), (2048, 768), (200, 72)):
        kept = grouped_wgrad._prune(configs, {"N": n, "K": k})
        assert kept and all(min(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) > 32 for c in kept), (n, k)
    assert len(grouped_wgrad._prune(configs, {"N": 1536, "K": 2048})) == 11  # the tuned set, unchanged
