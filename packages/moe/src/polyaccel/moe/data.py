"""Training data for fine-tuning: packed SFT samples and synthetic tokens, sharded by rank.

A *sample* is one sequence of ``seq_len`` token ids with its labels (``-100`` where no loss
is taken; Transformers shifts labels inside the model). Sources:

- :class:`PackedDataset`: JSONL (``text``, ``prompt``/``completion`` or ``input_ids``
  records) or plain text, tokenized with the checkpoint's tokenizer (offline), each document
  ended with EOS, concatenated and cut into ``seq_len`` samples; the tail is padded and
  masked. Documents are packed without cross-document attention masking.
- :class:`SyntheticDataset`: uniform random tokens, an unbounded stream (benchmarks).

:class:`Batches` turns a source into per-rank micro-batches. Global sample ``i`` (counting
from the start of training over all ranks) is a pure function of ``(seed, i)``: finite sources
walk a fresh seeded permutation per epoch. Each optimizer step consumes
``micro_batch x grad_accum x dp`` samples; in micro-batch ``m`` rank ``r`` takes the ``r``-th
slice of ``micro_batch`` samples, so dp ranks together see exactly what one process with
``micro_batch x dp`` would. The position is one integer, saved in checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from polyaccel.moe.train_config import ConfigError, DataConfig

IGNORE_INDEX = -100


class PackedDataset:
    """Fixed-length samples packed from tokenized documents.

    Attributes:
        input_ids: [N, seq_len] int64.
        labels: [N, seq_len] int64, ``-100`` on prompt tokens and padding.
    """

    def __init__(self, input_ids: torch.Tensor, labels: torch.Tensor):
        self.input_ids, self.labels = input_ids, labels

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` in storage order: (input_ids [S], labels [S])."""
        return self.input_ids[index], self.labels[index]

    @classmethod
    def pack(cls, documents: Iterable[tuple[list[int], list[bool]]], seq_len: int,
             pad_id: int = 0) -> PackedDataset:
        """Concatenate ``(token_ids, loss_mask)`` documents and cut into ``seq_len`` samples."""
        ids: list[int] = []
        mask: list[bool] = []
        for doc_ids, doc_mask in documents:
            ids.extend(doc_ids)
            mask.extend(doc_mask)
        if not ids:
            raise ConfigError("the dataset is empty (no tokens after tokenization)")
        pad = -len(ids) % seq_len
        ids.extend([pad_id] * pad)
        mask.extend([False] * pad)
        t_ids = torch.tensor(ids, dtype=torch.long).view(-1, seq_len)
        t_mask = torch.tensor(mask, dtype=torch.bool).view(-1, seq_len)
        return cls(t_ids, t_ids.masked_fill(~t_mask, IGNORE_INDEX))


class SyntheticDataset:
    """Uniform random token ids in ``[0, vocab)``; sample ``i`` depends only on (seed, i)."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __len__(self) -> int:
        raise TypeError("a synthetic dataset is unbounded")

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return ids, ids.clone()


class Batches:
    """This rank's micro-batches, step by step, from a deterministic global sample order.

    :param source: a :class:`PackedDataset` or :class:`SyntheticDataset`.
    :param micro_batch: sequences per micro-batch per rank.
    :param grad_accum: micro-batches per optimizer step.
    :param dp_rank, dp_size: this rank's place among the data-parallel ranks.
    :param seed: order seed (epoch permutations).
    :param shuffle: permute finite sources each epoch.
    """

    def __init__(self, source: PackedDataset | SyntheticDataset, *, micro_batch: int, grad_accum: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, shuffle: bool = True):
        self.source, self.micro_batch, self.grad_accum = source, micro_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.position = 0  # global samples consumed, over all ranks
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def samples_per_step(self) -> int:
        """Global samples per optimizer step."""
        return self.micro_batch * self.grad_accum * self.dp_size

    def global_index(self, i: int) -> int:
        """Storage index of global sample ``i``."""
        if isinstance(self.source, SyntheticDataset):
            return i
        n = len(self.source)
        epoch, j = divmod(i, n)
        if not self.shuffle:
            return j
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
            self._perm = (epoch, torch.randperm(n, generator=g))
        return int(self._perm[1][j])

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        """The ``grad_accum`` micro-batches ``{"input_ids", "labels"}`` ([micro_batch, S]) of
        this rank for the next optimizer step; advances the position by a global step."""
        out = []
        for m in range(self.grad_accum):
            first = self.position + (m * self.dp_size + self.dp_rank) * self.micro_batch
            pairs = [self.source.sample(self.global_index(first + k)) for k in range(self.micro_batch)]
            out.append({"input_ids": torch.stack([p[0] for p in pairs]),
                        "labels": torch.stack([p[1] for p in pairs])})
        self.position += self.samples_per_step
        return out

    def __iter__(self) -> Iterator[list[dict[str, torch.Tensor]]]:
        while True:
            yield self.next_step()

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the global position (and the order seed, checked on load)."""
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint data order used seed {state['seed']}, this run seed {self.seed}")
        self.position = int(state["position"])


# --------------------------------------------------------------------------------------------
# Building a source from the config
# --------------------------------------------------------------------------------------------

def build_dataset(cfg: DataConfig, *, seq_len: int, vocab_size: int, seed: int = 0,
                  tokenizer_path: str | None = None) -> PackedDataset | SyntheticDataset:
    """The dataset ``cfg`` describes, checked against the model's ``vocab_size``.

    Raises :class:`ConfigError` for a missing file, an unusable record, a missing tokenizer
    or token ids outside ``[0, vocab_size)``.
    """
    chosen = [k for k in ("jsonl", "text", "synthetic") if getattr(cfg, k) is not None]
    if len(chosen) != 1:
        raise ConfigError("data: set exactly one of jsonl, text or synthetic"
                          + (f" (got {', '.join(chosen)})" if chosen else ""))
    if cfg.synthetic is not None:
        vocab = cfg.synthetic.vocab or vocab_size
        if vocab > vocab_size:
            raise ConfigError(f"data.synthetic.vocab={vocab} exceeds the model's vocab_size={vocab_size}")
        return SyntheticDataset(vocab, seq_len, seed)

    path = Path(cfg.jsonl or cfg.text)
    if not path.is_file():
        raise ConfigError(f"data.{chosen[0]}: file {path} does not exist")
    tokenizer = None

    def tok():
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer(cfg.tokenizer or tokenizer_path)
        return tokenizer

    docs = list(_jsonl_documents(path, cfg.field, tok, vocab_size) if cfg.jsonl else _text_documents(path, tok))
    for n, (ids, _) in enumerate(docs):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ConfigError(f"{path}: document {n + 1} has token id {bad[0]} outside the model's "
                              f"vocabulary [0, {vocab_size}); wrong tokenizer or model?")
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    return PackedDataset.pack(docs, seq_len, pad_id=min(pad, vocab_size - 1))


def load_tokenizer(path: str | None):
    """``AutoTokenizer`` from a local directory, never touching the network."""
    if path is None:
        raise ConfigError("text data needs a tokenizer: set model.path to a checkpoint with one, "
                          "or data.tokenizer to a tokenizer directory")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _token_ids(value: Any, vocab_size: int, where: str) -> list[int]:
    """The pre-tokenized ``input_ids`` of one record: integers in ``[0, vocab_size)``; anything
    else (floats, strings, out-of-vocabulary ids) is a :class:`ConfigError` naming ``where``."""
    if not isinstance(value, list):
        raise ConfigError(f"{where}: input_ids must be a list of integer token ids, got {type(value).__name__}")
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ConfigError(f"{where}: input_ids[{i}] = {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise ConfigError(f"{where}: input_ids[{i}] is token id {t} outside the model's vocabulary "
                              f"[0, {vocab_size}); wrong tokenizer or model?")
    return value


def _jsonl_documents(path: Path, field: str, tok, vocab_size: int) -> Iterator[tuple[list[int], list[bool]]]:
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ConfigError(f"{path}:{line_no}: a record must be a JSON object, got {type(rec).__name__}")
            if "input_ids" in rec:
                ids = _token_ids(rec["input_ids"], vocab_size, f"{path}:{line_no}")
                yield ids, [True] * len(ids)
            elif "prompt" in rec and "completion" in rec:
                prompt, completion = _text(rec, "prompt", path, line_no), _text(rec, "completion", path, line_no)
                t = tok()
                p, c = _encode(t, prompt), _encode(t, completion) + _eos(t)
                yield p + c, [False] * len(p) + [True] * len(c)
            elif field in rec:
                text = _text(rec, field, path, line_no)
                t = tok()
                ids = _encode(t, text) + _eos(t)
                yield ids, [True] * len(ids)
            else:
                raise ConfigError(f"{path}:{line_no}: record has no {field!r} field (nor prompt/completion "
                                  f"or input_ids); keys: {', '.join(rec)}")


def _text(rec: dict[str, Any], key: str, path: Path, line_no: int) -> str:
    """``rec[key]``, which must be a string."""
    if not isinstance(rec[key], str):
        raise ConfigError(f"{path}:{line_no}: {key!r} must be a string, got {type(rec[key]).__name__}")
    return rec[key]


def _text_documents(path: Path, tok) -> Iterator[tuple[list[int], list[bool]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    for para in text.split("\n\n"):
        if para.strip():
            t = tok()
            ids = _encode(t, para.strip()) + _eos(t)
            yield ids, [True] * len(ids)
