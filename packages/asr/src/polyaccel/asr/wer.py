"""Word error rate the way ASR benchmarks count it: both sides normalized first
(:func:`polyaccel.asr.text.normalize_text`), then substitutions, deletions and insertions
from jiwer, summed over the corpus.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from polyaccel.asr.text import normalize_text

__all__ = ["WerCounts", "normalize_text", "wer", "wer_counts"]


@dataclasses.dataclass(frozen=True, slots=True)
class WerCounts:
    """Edit counts over normalized words: WER = errors / ref_words."""

    substitutions: int
    deletions: int
    insertions: int
    ref_words: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    @property
    def wer(self) -> float:
        if self.ref_words == 0:
            return 0.0 if self.insertions == 0 else float("inf")
        return self.errors / self.ref_words

    def __add__(self, other: WerCounts) -> WerCounts:
        return WerCounts(self.substitutions + other.substitutions, self.deletions + other.deletions,
                         self.insertions + other.insertions, self.ref_words + other.ref_words)


def wer_counts(refs: Sequence[str], hyps: Sequence[str], normalize: bool = True) -> WerCounts:
    """Total substitutions, deletions and insertions of ``hyps`` against ``refs`` (pairwise)."""
    import jiwer

    if len(refs) != len(hyps):
        raise ValueError(f"{len(refs)} references but {len(hyps)} hypotheses")
    norm = normalize_text if normalize else (lambda s: " ".join(s.split()))
    total = WerCounts(0, 0, 0, 0)
    pairs_r, pairs_h = [], []
    for r, h in zip(refs, hyps):
        r, h = norm(r), norm(h)
        if not r:  # jiwer rejects empty references: every hypothesis word is an insertion
            total += WerCounts(0, 0, len(h.split()), 0)
        else:
            pairs_r.append(r)
            pairs_h.append(h)
    if pairs_r:
        out = jiwer.process_words(pairs_r, pairs_h)
        total += WerCounts(out.substitutions, out.deletions, out.insertions,
                           out.substitutions + out.deletions + out.hits)
    return total


def wer(refs: Sequence[str], hyps: Sequence[str], normalize: bool = True) -> float:
    """Corpus word error rate of ``hyps`` against ``refs`` after :func:`normalize_text`
    (0.0 = perfect; can exceed 1.0 with many insertions)."""
    return wer_counts(refs, hyps, normalize).wer
