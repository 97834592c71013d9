"""The weight-gradient autotuner's prune (CPU): skinny outputs (LoRA adapters' gradients)
try only the skinny tiles, other outputs only the others, and nothing is ever pruned away;
both ``.grad`` read orders are tried only when adding into ``.grad`` (or the one forced)."""

from __future__ import annotations

import types

from polyaccel.cuda import grouped_wgrad


def _configs():
    return [types.SimpleNamespace(kwargs={"BLOCK_N": bn, "BLOCK_K": bk, "GRAD_FIRST": first})
            for bn, bk, *_ in grouped_wgrad.CONFIGS for first in (False, True)]


def test_skinny_outputs_try_only_skinny_tiles_and_others_only_the_rest():
    configs = _configs()
    for n, k in ((2048, 16), (16, 2048), (1536, 64)):
        kept = grouped_wgrad._prune(configs, {"N": n, "K": k}, ACCUMULATE=False)
        assert kept and all(min(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) <= 32 for c in kept), (n, k)
    for n, k in ((1536, 2048), (2048, 768), (200, 72)):
        kept = grouped_wgrad._prune(configs, {"N": n, "K": k}, ACCUMULATE=False)
        assert kept and all(min(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]) > 32 for c in kept), (n, k)
    assert len(grouped_wgrad._prune(configs, {"N": 1536, "K": 2048}, ACCUMULATE=False)) == 11  # the tuned set


def test_both_grad_read_orders_are_tried_only_when_accumulating_unless_one_is_forced():
    configs = _configs()
    orders = lambda **kw: {c.kwargs["GRAD_FIRST"] for c in grouped_wgrad._prune(configs, {"N": 1536, "K": 2048}, **kw)}  # noqa: E731
    assert grouped_wgrad.GRAD_FIRST is None
    assert orders(ACCUMULATE=False) == {False}  # nothing read from .grad: one order
    assert orders(ACCUMULATE=True) == {False, True}
    assert len(grouped_wgrad._prune(configs, {"N": 1536, "K": 2048}, ACCUMULATE=True)) == 22
    tma = {c.kwargs["GRAD_FIRST"] for c in grouped_wgrad._prune_order(configs, {"ACCUMULATE": True})}
    assert tma == {False, True}
    for forced in (False, True):
        with grouped_wgrad.forced_order(forced):
            assert orders(ACCUMULATE=True) == {forced}
            assert orders(ACCUMULATE=False) == {False}
        assert grouped_wgrad.GRAD_FIRST is None
