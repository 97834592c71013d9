"""Greedy decoding over a static-shape decoder step, written once for every :class:`ASRModel`.

The loop feeds the prompt one token per step (so one ``decode_step`` graph serves prompt
and generation), applies the logits rules of Hugging Face ``generate()`` for Whisper
(``suppress_tokens`` always, ``begin_suppress_tokens`` at the first generated position),
takes the argmax, and keeps finished rows on ``eos``. Everything stays on the device; the
host looks at the ``finished`` flags every ``check_every`` steps only to stop early, which
never changes the tokens.

Shape legend: B batch (bucket), V vocab, T generated tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch


@dataclasses.dataclass(slots=True)
class Hypothesis:
    """One recognized utterance: generated token ids (prompt and ``eos`` excluded), the
    decoded text, and the mean log-probability of the generated tokens (``eos`` included)."""

    tokens: list[int]
    text: str = ""
    avg_logprob: float | None = None


class LogitsRules:
    """Additive logit biases: ``-inf`` on ``suppress`` ids at every step, and also on
    ``begin_suppress`` ids at the first generated step (as Hugging Face's
    ``SuppressTokensLogitsProcessor`` / ``SuppressTokensAtBeginLogitsProcessor``).
    The [V] bias tensors are built on the logits' device at first use."""

    def __init__(self, suppress: Sequence[int], begin_suppress: Sequence[int]) -> None:
        self.suppress, self.begin_suppress = list(suppress), list(begin_suppress)
        self._bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, logits_BV: torch.Tensor, first_step: bool) -> torch.Tensor:
        if self._bias is None or self._bias[0].device != logits_BV.device:
            always = torch.zeros(logits_BV.shape[-1], device=logits_BV.device)
            always[self.suppress] = float("-inf")
            first = always.clone()
            first[self.begin_suppress] = float("-inf")
            self._bias = (always, first)
        return logits_BV + self._bias[1 if first_step else 0]


StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.inference_mode()
def greedy_decode(step: StepFn, *, batch: int, num_real: int, prompt: Sequence[int], eos_id: int,
                  max_new_tokens: int, rules: LogitsRules, device: torch.device | str,
                  check_every: int = 8, with_logprobs: bool = True,
                  min_new_tokens: int = 0) -> list[Hypothesis]:
    """Greedy search for ``num_real`` sequences in a batch bucket of ``batch`` rows.

    ``step(tokens [B] int64, position [B] int64) -> logits [B, V] fp32`` runs the decoder one
    token for every row (updating its cache in place). Rows ``num_real..batch-1`` are padding:
    they start finished and are never read. ``eos`` is suppressed for the first
    ``min_new_tokens`` steps (Hugging Face's ``min_new_tokens``; benchmarks use it to force a
    fixed amount of work). Returns one :class:`Hypothesis` per real row (text left empty:
    the caller detokenizes).
    """
    if not prompt:
        raise ValueError("the prompt must hold at least the start token")
    position = torch.zeros(batch, dtype=torch.int64, device=device)
    for tok in prompt[:-1]:
        step(torch.full((batch,), tok, dtype=torch.int64, device=device), position)
        position += 1
    current = torch.full((batch,), prompt[-1], dtype=torch.int64, device=device)
    finished = torch.arange(batch, device=device) >= num_real
    out_BT = torch.full((batch, max_new_tokens), eos_id, dtype=torch.int64, device=device)
    logprob_sum = torch.zeros(batch, device=device)
    counted = torch.zeros(batch, device=device)
    eos = torch.tensor(eos_id, device=device)
    steps = 0
    for t in range(max_new_tokens):
        logits_BV = rules.apply(step(current, position), first_step=(t == 0))
        if t < min_new_tokens:
            logits_BV[:, eos_id] = float("-inf")
        nxt = logits_BV.argmax(dim=-1)
        if with_logprobs:
            live = (~finished).float()
            lp = torch.log_softmax(logits_BV, dim=-1).gather(1, nxt[:, None])[:, 0]
            logprob_sum += lp * live
            counted += live
        nxt = torch.where(finished, eos, nxt)
        out_BT[:, t] = nxt
        finished |= nxt == eos_id
        current = nxt
        position += 1
        steps = t + 1
        if steps % check_every == 0 and bool(finished.all()):
            break

    tokens = out_BT[:num_real, :steps].tolist()
    avg = (logprob_sum / counted.clamp(min=1)).tolist() if with_logprobs else [None] * num_real
    hyps = []
    for i in range(num_real):
        row = tokens[i]
        end = row.index(eos_id) if eos_id in row else len(row)
        hyps.append(Hypothesis(row[:end], avg_logprob=avg[i]))
    return hyps
