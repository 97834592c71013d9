"""Greedy decoding over a static-shape decoder step, written once for every :class:`ASRModel`.

The loop feeds the prompt one token per step (so one ``decode_step`` graph serves prompt
and generation), applies the logits rules of Hugging Face ``generate()`` for Whisper
(``suppress_tokens`` always, ``begin_suppress_tokens`` at the first generated position),
takes the argmax, and keeps finished rows on ``eos``. Everything stays on the device; the
host looks at the ``finished`` flags every ``check_every`` steps only to stop early, which
never changes the tokens. It reads each check with the next step already queued, so a batch
whose rows all ended runs one step past the check (a step that changes nothing), and the
device never idles waiting for the host to read a check.

Shape legend: B batch (bucket), V vocab, T generated tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from polyaccel.core import ops


@dataclasses.dataclass(slots=True)
class Hypothesis:
    """One recognized utterance: generated token ids (prompt and ``eos`` excluded), the
    decoded text, the mean log-probability of the generated tokens (``eos`` included), and the
    probability the model gave its no-speech token right after the start token (Whisper's
    ``no_speech_prob``; None unless asked for)."""

    tokens: list[int]
    text: str = ""
    avg_logprob: float | None = None
    segments: list[Segment] | None = None
    no_speech_prob: float | None = None


@dataclasses.dataclass(slots=True, frozen=True)
class Segment:
    """A stretch of speech Whisper delimited with timestamp tokens: seconds from the start of
    the window it was decoded in (or of the file, once stitched) and its text."""

    start: float
    end: float
    text: str


@dataclasses.dataclass(slots=True, frozen=True)
class TimestampRules:
    """Whisper's timestamp-token rules (the behaviour of Hugging Face's
    ``WhisperTimeStampLogitsProcessor``), applied by :func:`greedy_update` after the suppress
    biases, as graph-capturable tensor ops over the generated ids so far (``GreedyBuffers.out``
    and ``step``), with no extra state and no host sync:

    - ``<|notimestamps|>`` never;
    - the first generated token is a timestamp, at most ``max_initial_index`` (x 0.02 s);
    - timestamps come in pairs: after a lone timestamp (one preceded by text) the next token is
      a timestamp or ``eos``; after a pair (or the first token) it is text or ``eos``;
    - timestamps never decrease; a pair-closing one may repeat the last, any other is later;
    - when the summed probability of all timestamps exceeds that of the likeliest text token
      (``<|endoftext|>`` and specials count as text here), a timestamp is forced.

    Ids: ``begin`` is the first timestamp token (``<|0.00|>``), ``no_timestamps`` the one before
    it; ``eos`` bounds the "text" range of the pairing rule (ids below it).
    """

    begin: int
    no_timestamps: int
    eos: int
    max_initial_index: int | None = None
    precision_s: float = 0.02

    def apply(self, logits_BV: torch.Tensor, out_BT: torch.Tensor, step_1: torch.Tensor) -> torch.Tensor:
        """``logits`` (suppress biases already added) with the rules' ``-inf``s; ``out`` holds
        the generated ids of the first ``step`` steps (the rest is ``eos``)."""
        B, V = logits_BV.shape
        T = out_BT.shape[1]
        vocab = torch.arange(V, device=logits_BV.device)[None, :]                       # [1, V]
        step = step_1.reshape(1, 1)                                                     # [1, 1]
        cols = torch.arange(T, device=out_BT.device)[None, :]
        is_ts = (out_BT >= self.begin) & (cols < step)                                  # [B, T] generated timestamps
        last = out_BT.gather(1, (step - 1).clamp(0, T - 1).expand(B, 1))                # [B, 1]
        penult = out_BT.gather(1, (step - 2).clamp(0, T - 1).expand(B, 1))
        last_ts = (step >= 1) & (last >= self.begin)
        penult_ts = (step < 2) | (penult >= self.begin)
        # the last timestamp is the largest: the rules below keep them non-decreasing
        latest = torch.where(is_ts, out_BT, torch.full_like(out_BT, -1)).amax(1, keepdim=True)
        mask = (vocab == self.no_timestamps).expand(B, V)
        mask = mask | last_ts & penult_ts & (vocab >= self.begin)                             # after a pair: no timestamp
        mask |= last_ts & ~penult_ts & (vocab < self.eos)                               # after a lone one: no text
        floor = torch.where(last_ts & ~penult_ts, latest, latest + 1)
        mask |= (latest >= 0) & (vocab >= self.begin) & (vocab < floor)                 # never earlier
        first = step == 0
        mask |= first & (vocab < self.begin)                                            # start with a timestamp
        if self.max_initial_index is not None:
            mask |= first & (vocab > self.begin + self.max_initial_index)
        logits_BV = logits_BV.masked_fill(mask, float("-inf"))  # no host tensor: graph-capturable
        logprobs = torch.log_softmax(logits_BV.float(), dim=-1)
        ts_mass = logprobs[:, self.begin:].logsumexp(dim=-1, keepdim=True)
        best_text = logprobs[:, :self.begin].amax(dim=-1, keepdim=True)
        return logits_BV.masked_fill((ts_mass > best_text) & (vocab < self.begin), float("-inf"))

    def segments(self, tokens: Sequence[int], decode: Callable[[list[int]], str],
                 window_s: float) -> list[Segment]:
        """Segments of one window's generated ids (prompt and ``eos`` excluded), cut as Hugging
        Face's Whisper ``generate(return_timestamps=True)`` cuts them: at each pair of
        consecutive timestamps; a final lone timestamp closes the last segment; text after
        the last pair that no timestamp closes (speech cut off at the window's end) is a last
        segment ending at ``window_s``. No pair at all: one segment from 0 to the last
        timestamp (or to ``window_s``)."""
        toks = list(tokens)
        if not toks:
            return []
        is_ts = [t >= self.begin for t in toks]
        p = self.precision_s

        def text(ids: Sequence[int]) -> str:
            return decode([t for t in ids if t < self.begin]).strip()

        cuts = [i + 1 for i in range(len(toks) - 1) if is_ts[i] and is_ts[i + 1]]
        single_ending = len(toks) >= 2 and not is_ts[-2] and is_ts[-1]
        if not cuts:
            stamps = [t for t in toks if t >= self.begin]
            end = (stamps[-1] - self.begin) * p if stamps and stamps[-1] != self.begin else window_s
            return [Segment(0.0, round(end, 3), text(toks))] if text(toks) else []
        out: list[Segment] = []
        last = 0
        for c in cuts + ([len(toks)] if single_ending else []):
            piece = toks[last:c]
            if len(piece) >= 2 and piece[0] >= self.begin and piece[-1] >= self.begin:
                out.append(Segment(round((piece[0] - self.begin) * p, 3), round((piece[-1] - self.begin) * p, 3),
                                   text(piece)))
            last = c
        tail = toks[last:]
        if not single_ending and any(t < self.begin for t in tail) and tail[0] >= self.begin:
            out.append(Segment(round((tail[0] - self.begin) * p, 3), round(window_s, 3), text(tail)))
        return [s for s in out if s.text]


class LogitsRules:
    """Additive logit biases: ``-inf`` on ``suppress`` ids at every step, on ``begin_suppress``
    ids at the first generated step (as Hugging Face's ``SuppressTokensLogitsProcessor`` /
    ``SuppressTokensAtBeginLogitsProcessor``), and on ``eos`` while fewer than
    ``min_new_tokens`` tokens exist. The [V] bias tensors are built once per device."""

    def __init__(self, suppress: Sequence[int], begin_suppress: Sequence[int], eos_id: int | None = None,
                 min_new_tokens: int = 0) -> None:
        self.suppress, self.begin_suppress = list(suppress), list(begin_suppress)
        self.eos_id, self.min_new_tokens = eos_id, min_new_tokens
        self._bias: dict[tuple[bool, bool], torch.Tensor] = {}
        self._key: tuple[int, torch.device] | None = None

    def bias(self, step: int, vocab_size: int, device: torch.device | str) -> torch.Tensor:
        """The [V] fp32 bias for generated step ``step`` (0-based). Same tensor for same kind."""
        if self._key != (vocab_size, torch.device(device)):
            self._bias.clear()
            self._key = (vocab_size, torch.device(device))
        kind = (step == 0, self.eos_id is not None and step < self.min_new_tokens)
        b = self._bias.get(kind)
        if b is None:
            b = torch.zeros(vocab_size, device=device)
            b[self.suppress] = float("-inf")
            if kind[0]:
                b[self.begin_suppress] = float("-inf")
            if kind[1]:
                b[self.eos_id] = float("-inf")
            self._bias[kind] = b
        return b

    def apply(self, logits_BV: torch.Tensor, first_step: bool) -> torch.Tensor:
        """``logits`` plus the suppress biases of the first (or a later) step."""
        return logits_BV + self.bias(0 if first_step else max(1, self.min_new_tokens), logits_BV.shape[-1],
                                     logits_BV.device)


@dataclasses.dataclass(slots=True)
class GreedyBuffers:
    """Device tensors one greedy loop reads and updates in place, fixed per batch bucket, so
    the whole step (decoder, bias, argmax, bookkeeping) can be one captured graph.

    tokens/position [B] int64: the next input token and its position; finished [B] bool;
    logprob_sum/counted [B] fp32; out [B, T] int64 generated ids; step [1] int64.
    """

    tokens: torch.Tensor
    position: torch.Tensor
    finished: torch.Tensor
    logprob_sum: torch.Tensor
    counted: torch.Tensor
    out: torch.Tensor
    step: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, max_new_tokens: int, device: torch.device | str) -> GreedyBuffers:
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(batch, **i64), torch.zeros(batch, **i64),
                   torch.zeros(batch, dtype=torch.bool, device=device), torch.zeros(batch, device=device),
                   torch.zeros(batch, device=device), torch.zeros(batch, max(1, max_new_tokens), **i64),
                   torch.zeros(1, **i64))

    def tensors(self) -> list[torch.Tensor]:
        return [self.tokens, self.position, self.finished, self.logprob_sum, self.counted, self.out, self.step]

    def reset(self, num_real: int, eos_id: int) -> None:
        self.position.zero_()
        self.finished.copy_(torch.arange(self.finished.shape[0], device=self.finished.device) >= num_real)
        self.logprob_sum.zero_()
        self.counted.zero_()
        self.out.fill_(eos_id)
        self.step.zero_()


def greedy_update(logits_BV: torch.Tensor, bias_V: torch.Tensor, buf: GreedyBuffers, eos_id: int,
                  timestamps: TimestampRules | None = None) -> None:
    """One greedy step's bookkeeping, in place and graph-capturable (no host syncs): argmax of
    ``logits + bias`` (then the timestamp rules, if given), its log-probability, ``eos`` for
    finished rows, and the next input."""
    if timestamps is not None:  # the rules read the biased scores; nothing is added after them
        logits_BV, bias_V = timestamps.apply(logits_BV.float() + bias_V, buf.out, buf.step), torch.zeros_like(bias_V)
    ops.greedy_advance_(logits_BV, bias_V, buf.tokens, buf.position, buf.finished, buf.logprob_sum, buf.counted,
                        buf.out, buf.step, eos_id)
    buf.step.add_(1)


class _FinishedCheck:
    """"Has every row finished?", asked after one step and read after the next is queued: on
    CUDA the answer is copied into pinned host memory without blocking, so the host waits on
    it while the device runs the next step, instead of the device idling while the host
    reads the answer and queues that step (~90 us per check at batch 1 on an H200)."""

    def __init__(self, finished_B: torch.Tensor) -> None:
        self.finished = finished_B
        self.cuda = finished_B.device.type == "cuda"
        self.host = torch.zeros((), dtype=torch.bool, pin_memory=self.cuda)
        self.event = torch.cuda.Event() if self.cuda else None

    def record(self) -> None:
        self.host.copy_(self.finished.all(), non_blocking=self.cuda)
        if self.event is not None:
            self.event.record()

    def read(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AdvanceFn = Callable[[torch.Tensor], object]


@torch.inference_mode()
def greedy_decode(step: StepFn, *, batch: int, num_real: int, prompt: Sequence[int], eos_id: int,
                  max_new_tokens: int, rules: LogitsRules, device: torch.device | str,
                  check_every: int = 8, with_logprobs: bool = True, min_new_tokens: int | None = None,
                  buffers: GreedyBuffers | None = None, advance: AdvanceFn | None = None,
                  vocab_size: int | None = None, timestamps: TimestampRules | None = None,
                  no_speech_id: int | None = None) -> list[Hypothesis]:
    """Greedy search for ``num_real`` sequences in a batch bucket of ``batch`` rows.

    ``step(tokens [B] int64, position [B] int64) -> logits [B, V] fp32`` runs the decoder one
    token for every row (updating its cache in place). Rows ``num_real..batch-1`` are padding:
    they start finished and are never read. ``eos`` is suppressed for the first
    ``min_new_tokens`` steps (Hugging Face's ``min_new_tokens``; benchmarks use it to force a
    fixed amount of work; default: the rules' own). ``advance(bias)``, when given, performs a
    whole generated step on ``buffers`` in place (the runner passes a captured graph of
    :func:`greedy_update` over the decoder step); ``step`` then only feeds the prompt.
    ``timestamps``: apply Whisper's timestamp rules (the prompt must then leave out
    ``<|notimestamps|>``; ``advance`` must apply them too). ``no_speech_id``: give each
    hypothesis the probability of that token in the logits after the first prompt token (the
    prompt must then hold at least two tokens).
    Returns one :class:`Hypothesis` per real row (text left empty: the caller detokenizes).
    """
    if not prompt:
        raise ValueError("the prompt must hold at least the start token")
    if min_new_tokens is not None and min_new_tokens != rules.min_new_tokens:
        rules = LogitsRules(rules.suppress, rules.begin_suppress, eos_id, min_new_tokens)
    elif rules.eos_id is None and rules.min_new_tokens:
        rules.eos_id = eos_id
    buf = buffers if buffers is not None else GreedyBuffers.allocate(batch, max_new_tokens, device)
    buf.reset(num_real, eos_id)
    if no_speech_id is not None and len(prompt) < 2:
        raise ValueError("no_speech_id needs a prompt of at least two tokens")
    logits = no_speech = None
    for i, tok in enumerate(prompt[:-1]):
        buf.tokens.fill_(tok)
        logits = step(buf.tokens, buf.position)
        if i == 0 and no_speech_id is not None:
            no_speech = torch.softmax(logits[:num_real].float(), dim=-1)[:, no_speech_id]
        buf.position.add_(1)
    buf.tokens.fill_(prompt[-1])
    steps, check, pending = 0, _FinishedCheck(buf.finished), 0
    for t in range(max_new_tokens):
        if advance is not None:
            advance(rules.bias(t, vocab_size, device))
        else:
            logits = step(buf.tokens, buf.position)
            greedy_update(logits, rules.bias(t, logits.shape[-1], logits.device), buf, eos_id, timestamps)
        steps = t + 1
        if pending:  # read with this step already queued: the device does not wait for the host
            if check.read():
                steps = pending  # the step after it changed nothing (every row was finished)
                break
            pending = 0
        if steps % check_every == 0 and steps < max_new_tokens:
            check.record()
            pending = steps

    tokens = buf.out[:num_real, :steps].tolist()
    avg = (buf.logprob_sum / buf.counted.clamp(min=1)).tolist() if with_logprobs else [None] * num_real
    no_speech_probs = no_speech.tolist() if no_speech is not None else [None] * num_real
    hyps = []
    for i in range(num_real):
        row = tokens[i]
        end = row.index(eos_id) if eos_id in row else len(row)
        hyps.append(Hypothesis(row[:end], avg_logprob=avg[i], no_speech_prob=no_speech_probs[i]))
    return hyps
