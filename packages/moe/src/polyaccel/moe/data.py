"""Training data for fine-tuning: packed SFT samples and synthetic tokens, sharded by rank.

A *sample* is one sequence of ``seq_len`` token ids with its labels (``-100`` where no loss
is taken; Transformers shifts labels inside the model). Sources:

- :class:`PackedDataset`: JSONL (``text``, ``prompt``/``completion`` or ``input_ids``
  records) or plain text, tokenized with the checkpoint's tokenizer (offline), each document
  ended with EOS (pre-tokenized ``input_ids`` are taken as they are, with their optional
  ``labels``), concatenated and cut into ``seq_len`` samples that overlap by one token, so
  that every token but the very first is a loss target exactly once (the model shifts labels:
  a sample's first token is never one); the tail is padded and masked. Documents are packed
  without cross-document attention masking (full causal attention within a sample).
- :class:`MappedDataset`: the same samples, cut on demand from the memory-mapped token cache
  of a file (:mod:`polyaccel.moe.data_cache`), tokenized once for every process and resume.
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
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polyaccel.moe.train_config import ConfigError, DataConfig

IGNORE_INDEX = -100
logger = logging.getLogger("polyaccel.moe")


def _generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``; values outside what ``manual_seed`` takes
    ([-2**63, 2**64)) are folded into it (those inside keep their streams)."""
    if not -2**63 <= seed < 2**64:
        seed %= 2**64
    return torch.Generator().manual_seed(seed)


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
        """Concatenate ``(token_ids, loss_mask)`` documents and cut the stream into ``seq_len``
        samples, each starting on the last token of the one before: the model shifts labels
        (position 0 of a sample is never a target), so every token after the first is a target
        in exactly one sample. The tail is padded with ``pad_id`` and masked."""
        if seq_len < 2:
            raise ConfigError(f"train.seq_len must be >= 2 for packed data (a sample of {seq_len} token "
                              "has no next token to predict)")
        # One int64 and one bool array per document (9 bytes a token, not a Python list's ~40).
        ids, mask = [], []
        for doc_ids, doc_mask in documents:
            ids.append(np.asarray(doc_ids, dtype=np.int64))
            mask.append(np.asarray(doc_mask, dtype=bool))
        total = sum(len(a) for a in ids)
        if not total:
            raise ConfigError("the dataset is empty (no tokens after tokenization)")
        stride = seq_len - 1
        pad = -(total - 1) % stride if total > 1 else stride
        ids.append(np.full(pad, pad_id, dtype=np.int64))
        mask.append(np.zeros(pad, dtype=bool))
        flat_ids, flat_mask = np.concatenate(ids), np.concatenate(mask)
        del ids, mask  # (the per-document arrays, before the samples' copy)
        t_ids = torch.from_numpy(flat_ids).unfold(0, seq_len, stride).contiguous()
        t_mask = torch.from_numpy(flat_mask).unfold(0, seq_len, stride).clone()
        t_mask[:, 0] = False  # the previous sample's last target (or the stream's first token)
        return cls(t_ids, t_ids.masked_fill(~t_mask, IGNORE_INDEX))


class MappedDataset:
    """The samples :meth:`PackedDataset.pack` would make, cut on demand from a memory-mapped
    token stream (:class:`polyaccel.moe.data_cache.TokenCache`): resident memory does not grow
    with the data. Sample ``i`` covers stream positions ``[i * (seq_len - 1), ... + seq_len)``,
    the tail padded with ``cache.pad_id`` and masked."""

    def __init__(self, cache: Any, seq_len: int):
        if seq_len < 2:
            raise ConfigError(f"train.seq_len must be >= 2 for packed data (a sample of {seq_len} token "
                              "has no next token to predict)")
        self.cache, self.seq_len, self.stride = cache, seq_len, seq_len - 1
        total = len(cache.tokens)
        padded = total + (-(total - 1) % self.stride if total > 1 else self.stride)
        self.n = (padded - 1) // self.stride

    def __len__(self) -> int:
        return self.n

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` in storage order: (input_ids [S], labels [S]), int64."""
        if not 0 <= index < self.n:
            raise IndexError(f"sample {index} of {self.n}")
        start = index * self.stride
        ids = np.full(self.seq_len, self.cache.pad_id, dtype=np.int64)
        mask = np.zeros(self.seq_len, dtype=bool)
        part = self.cache.tokens[start:start + self.seq_len]
        self._in_vocab(part, start)
        ids[:len(part)] = part
        mask[:len(part)] = self.cache.mask[start:start + self.seq_len]
        mask[0] = False  # the previous sample's last target (or the stream's first token)
        t_ids = torch.from_numpy(ids)
        return t_ids, t_ids.masked_fill(torch.from_numpy(~mask), IGNORE_INDEX)

    def _in_vocab(self, part: np.ndarray, start: int) -> None:
        """A ConfigError naming the cache where ``part`` (from stream position ``start``) holds an
        id outside the vocabulary: a cache altered after it was built, its CRCs recomputed."""
        if len(part) and int(part.max()) >= self.cache.vocab_size:
            at = int(np.argmax(part >= self.cache.vocab_size))
            raise ConfigError(f"data cache {self.cache.folder}: token id {int(part[at])} at position {start + at} "
                              f"is outside the model's vocabulary [0, {self.cache.vocab_size}); it was changed "
                              "after it was built: remove that folder to rebuild it")


class SyntheticDataset:
    """Uniform random token ids in ``[0, vocab)``; sample ``i`` depends only on (seed, i)."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __len__(self) -> int:
        raise TypeError("a synthetic dataset is unbounded")

    def sample(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=g)
        return ids, ids.clone()


class Batches:
    """This rank's micro-batches, step by step, from a deterministic global sample order.

    :param source: a :class:`PackedDataset`, :class:`MappedDataset` or :class:`SyntheticDataset`.
    :param micro_batch: sequences per micro-batch per rank.
    :param grad_accum: micro-batches per optimizer step.
    :param dp_rank, dp_size: this rank's place among the data-parallel ranks.
    :param seed: order seed (epoch permutations).
    :param shuffle: permute finite sources each epoch.
    """

    def __init__(self, source: PackedDataset | MappedDataset | SyntheticDataset, *, micro_batch: int, grad_accum: int,
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
            g = _generator(self.seed * 7919 + epoch)
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

    def _samples(self) -> int | None:
        """Samples per epoch (``None`` for an unbounded source)."""
        return None if isinstance(self.source, SyntheticDataset) else len(self.source)

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: the global position, and what fixes the order it counts in
        (seed, samples per epoch, shuffle), checked on load."""
        return {"position": self.position, "seed": self.seed, "samples": self._samples(), "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position; a :class:`ValueError` where this run's samples or
        order differ from the checkpoint's (the position would then skip or repeat samples).
        Keys an older checkpoint lacks are not checked."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"checkpoint data order used seed {state['seed']}, this run seed {self.seed}")
        if state.get("samples") is not None and state["samples"] != self._samples():
            raise ValueError(f"checkpoint data position counts {state['samples']} samples per epoch, this run's "
                             f"data packs into {self._samples()} (other data, data settings or train.seq_len)")
        if state.get("shuffle", self.shuffle) != self.shuffle:
            raise ValueError(f"checkpoint data order used data.shuffle={state['shuffle']}, this run "
                             f"data.shuffle={self.shuffle}")
        self.position = int(state["position"])


# --------------------------------------------------------------------------------------------
# Building a source from the config
# --------------------------------------------------------------------------------------------

def build_dataset(cfg: DataConfig, *, seq_len: int, vocab_size: int, seed: int = 0,
                  tokenizer_path: str | None = None,
                  cache_dir: str | Path | None = None) -> PackedDataset | MappedDataset | SyntheticDataset:
    """The dataset ``cfg`` describes, checked against the model's ``vocab_size``.

    With ``cache_dir`` (and ``cfg.cache``), a file's tokens come from a token cache there,
    built once (:mod:`polyaccel.moe.data_cache`) and memory-mapped; where it cannot be
    written, one warning, and the data is tokenized in memory as without ``cache_dir``.

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

    path, key = Path(cfg.jsonl or cfg.text), f"data.{chosen[0]}"
    tok = _LazyTokenizer(cfg.tokenizer or tokenizer_path)

    def documents(progress=None, notes=None) -> Iterator[tuple[list[int], list[bool]]]:
        if cfg.jsonl:
            return _jsonl_documents(path, cfg.field, tok, vocab_size, progress, notes)
        return _text_documents(path, tok, vocab_size, progress)

    # OSError: a folder on its way this user may not enter, a file it may not read, an I/O error
    try:
        if not path.is_file():
            why = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
            raise ConfigError(f"{key}: file {path} {why}", key=key)
        if cache_dir is not None and cfg.cache:
            mapped = _mapped_dataset(cfg, path, key, tok, documents, Path(cache_dir), seq_len, vocab_size)
            if mapped is not None:
                return mapped
        docs = list(documents())
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror or e})", key=key) from None
    if not any(ids for ids, _ in docs):
        raise ConfigError(f"{key}: {path} is empty (no tokens after tokenization)")
    packed = PackedDataset.pack(docs, seq_len, pad_id=tok.pad_id(vocab_size))
    if not (packed.labels != IGNORE_INDEX).any():  # a run on it would train nothing and "succeed"
        raise _nothing_to_train(key, path)
    return packed


def _nothing_to_train(key: str, path: Path) -> ConfigError:
    return ConfigError(f"{key}: {path} has no token to train on (every label is -100, or the "
                       "data is one token: the first token is never a target)")


def _mapped_dataset(cfg: DataConfig, path: Path, key: str, tok: _LazyTokenizer, documents, cache_dir: Path,
                    seq_len: int, vocab_size: int) -> MappedDataset | None:
    """The data from its token cache in ``cache_dir`` (built first when missing or damaged), or
    None, after one warning, where the cache cannot be written."""
    from polyaccel.moe import data_cache

    def check(tokens: int, has_target: bool) -> None:
        if not tokens:
            raise ConfigError(f"{key}: {path} is empty (no tokens after tokenization)")
        if not has_target:
            raise _nothing_to_train(key, path)

    try:
        cache = data_cache.open_cache(cache_dir, data_cache.key_material(cfg, tok.path, vocab_size), documents,
                                      source=path, vocab_size=vocab_size, pad_id=lambda: tok.pad_id(vocab_size),
                                      check=check)
    except data_cache.CacheUnwritable as e:
        logger.warning("polyaccel.moe: data cache: %s; tokenizing %s in memory instead (data.cache)", e, path)
        return None
    return MappedDataset(cache, seq_len)


class _LazyTokenizer:
    """The tokenizer of ``path``, loaded on the first call (pre-tokenized data never loads it)."""

    def __init__(self, path: str | None):
        self.path, self.loaded = path, None

    def __call__(self):
        if self.loaded is None:
            self.loaded = load_tokenizer(self.path)
        return self.loaded

    def pad_id(self, vocab_size: int) -> int:
        """The padding id: the tokenizer's, where one was loaded and has one, else 0."""
        pad = self.loaded.pad_token_id if self.loaded is not None and self.loaded.pad_token_id is not None else 0
        return min(pad, vocab_size - 1)


#: files of which a tokenizer folder holds at least one (fast, SentencePiece, BPE or WordPiece)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "spiece.model", "sentencepiece.bpe.model", "merges.txt")


def load_tokenizer(path: str | None):
    """``AutoTokenizer`` from a local directory, never touching the network nor running the
    directory's own code (a ``tokenizer_config.json`` with ``auto_map`` is refused, never
    prompted for: a "y" on stdin would run it)."""
    if path is None:
        raise ConfigError("text data needs a tokenizer: set model.path to a checkpoint with one, "
                          "or data.tokenizer to a tokenizer directory")
    if not Path(path).is_dir():  # else Transformers reads it as a Hub repo id and says that is malformed
        why = ("a file, not the tokenizer's folder (name the folder holding tokenizer.json)" if Path(path).exists()
               else "no such directory")
        raise ConfigError(f"cannot load a tokenizer from {path}: {why}", key="data.tokenizer")
    if not any((Path(path) / name).is_file() for name in _TOKENIZER_FILES):
        # Transformers then builds an empty tokenizer from config.json's model_type: every text
        # became nothing but EOS, and a run trained on that and exited 0
        raise ConfigError(f"cannot load a tokenizer from {path}: it holds no tokenizer files ("
                          f"{', '.join(_TOKENIZER_FILES[:4])}, ...); copy the model's tokenizer there or set "
                          "data.tokenizer to its folder", key="data.tokenizer")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {' '.join(str(e).split())}") from e
    except Exception as e:  # a damaged file: tokenizers' bare Exception, KeyError, TypeError... from its parsing
        raise ConfigError(f"cannot load a tokenizer from {path}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]}") from e
    if len(tokenizer.get_vocab()) <= len(set(tokenizer.all_special_ids)):
        raise ConfigError(f"cannot load a tokenizer from {path}: its vocabulary is empty (only special tokens; "
                          "its vocabulary files are missing?)", key="data.tokenizer")
    return tokenizer


def _encode(tokenizer, text: str) -> list[int]:
    """``text``'s token ids. ``verbose=False``: a document longer than the tokenizer's
    ``model_max_length`` is packed into ``seq_len`` samples, never run whole, so Transformers'
    "will result in indexing errors" warning would be false."""
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _eos(tokenizer) -> list[int]:
    """The EOS that ends each document; a tokenizer without one is a :class:`ConfigError`
    (packed documents would run into each other with nothing between them)."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer {getattr(tokenizer, 'name_or_path', '')!s} has no eos_token, which ends "
                          "each packed document; set eos_token in its tokenizer_config.json")
    return [tokenizer.eos_token_id]


def _in_vocab(ids: list[int], vocab_size: int, where: str) -> list[int]:
    """``ids``, which the tokenizer made: a :class:`ConfigError` naming ``where`` (file and line)
    for the first outside ``[0, vocab_size)``."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"{where}: the tokenizer gave token id {bad}, outside the model's vocabulary "
                          f"[0, {vocab_size}); wrong tokenizer or model?")
    return ids


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


def _token_labels(rec: dict[str, Any], ids: list[int], where: str) -> list[bool]:
    """The loss mask of a pre-tokenized record: from its optional ``labels`` (each ``-100`` or
    the input id at that position; the model shifts them), else all ``True``."""
    if "labels" not in rec:
        return [True] * len(ids)
    labels = rec["labels"]
    if not isinstance(labels, list):
        raise ConfigError(f"{where}: labels must be a list of token ids or {IGNORE_INDEX}, got {type(labels).__name__}")
    if len(labels) != len(ids):
        raise ConfigError(f"{where}: labels has {len(labels)} entries, input_ids {len(ids)}")
    for i, (label, t) in enumerate(zip(labels, ids, strict=True)):
        if isinstance(label, bool) or label not in (IGNORE_INDEX, t):
            raise ConfigError(f"{where}: labels[{i}] = {label!r} is neither {IGNORE_INDEX} nor input_ids[{i}] = {t} "
                              "(labels are the input ids, unshifted, with -100 where no loss is taken)")
    return [label != IGNORE_INDEX for label in labels]


def _lines(path: Path, progress=None) -> Iterator[tuple[int, str]]:
    """``(line_no, text)`` of a UTF-8 file read line by line (a leading byte order mark dropped);
    ``progress(n)``, when given, is told the bytes of each line read."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if progress is not None:
                progress(len(raw))
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{line_no}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
            yield line_no, line


def _jsonl_documents(path: Path, field: str, tok, vocab_size: int, progress=None,
                     notes: list[str] | None = None) -> Iterator[tuple[list[int], list[bool]]]:
    """``(token_ids, loss_mask)`` per record; records with nothing to train on (an empty or
    whitespace-only text, prompt and completion, or ``input_ids``) are skipped with a warning
    (also appended to ``notes``, when given)."""
    skipped: list[int] = []
    for line_no, line in _lines(path, progress):
        if not line.strip():
            continue
        doc = _record_document(_record(line, path, line_no), field, tok, vocab_size, f"{path}:{line_no}")
        if doc is None:
            skipped.append(line_no)
        else:
            yield doc
    if skipped:
        note = (f"{path}: skipped {len(skipped)} empty records (lines "
                + ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "") + ")")
        logger.warning("polyaccel.moe: %s", note)
        if notes is not None:
            notes.append(note)


def _record(line: str, path: Path, line_no: int) -> dict[str, Any]:
    """One JSONL line as a JSON object."""
    try:
        rec = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or an integer of more digits than Python converts
        hint = ("; JSONL needs one whole JSON object per line, and this looks like a JSON file spread over lines"
                if line.strip() in ("[", "{") else "")
        raise ConfigError(f"{path}:{line_no}: not valid JSON ({e}){hint}") from None
    except RecursionError:
        raise ConfigError(f"{path}:{line_no}: not valid JSON (nested too deeply)") from None
    if not isinstance(rec, dict):
        raise ConfigError(f"{path}:{line_no}: a record must be a JSON object, got {type(rec).__name__}")
    return rec


def _record_document(rec: dict[str, Any], field: str, tok, vocab_size: int,
                     where: str) -> tuple[list[int], list[bool]] | None:
    """A record's ``(token_ids, loss_mask)``, or ``None`` when it holds nothing to train on."""
    if "input_ids" in rec:
        ids = _token_ids(rec["input_ids"], vocab_size, where)
        return (ids, _token_labels(rec, ids, where)) if ids else None
    if "prompt" in rec and "completion" in rec:
        prompt, completion = _text(rec, "prompt", where), _text(rec, "completion", where)
        if not (prompt.strip() or completion.strip()):
            return None
        t = tok()
        p, c = _encode(t, prompt), _encode(t, completion) + _eos(t)
        return _in_vocab(p + c, vocab_size, where), [False] * len(p) + [True] * len(c)
    if field in rec:
        text = _text(rec, field, where)
        if not text.strip():
            return None
        t = tok()
        ids = _in_vocab(_encode(t, text) + _eos(t), vocab_size, where)
        return ids, [True] * len(ids)
    half = next((f"'{a}' without '{b}'" for a, b in (("prompt", "completion"), ("completion", "prompt")) if a in rec),
                None)
    if half:  # one half of a prompt/completion record
        raise ConfigError(f"{where}: record has {half} (nor a {field!r} field); keys: {', '.join(rec)}")
    raise ConfigError(f"{where}: record has no {field!r} field (nor prompt/completion "
                      f"or input_ids); keys: {', '.join(rec)}")


def _text(rec: dict[str, Any], key: str, where: str) -> str:
    """``rec[key]``, which must be a string."""
    if not isinstance(rec[key], str):
        raise ConfigError(f"{where}: {key!r} must be a string, got {type(rec[key]).__name__}")
    try:
        rec[key].encode("utf-8")
    except UnicodeEncodeError as e:  # a JSON escape of half a surrogate pair: valid JSON, no text
        raise ConfigError(f"{where}: {key!r} is not valid Unicode (a lone surrogate at character {e.start})") from None
    return rec[key]


def _text_documents(path: Path, tok, vocab_size: int, progress=None) -> Iterator[tuple[list[int], list[bool]]]:
    """One document per paragraph of a text file, read line by line; blank or whitespace-only
    lines separate them (token ids outside the vocabulary are named by the paragraph's first line)."""
    para: list[str] = []
    first = 0
    for line_no, line in _text_lines(path, progress):
        if line.strip():
            first = first if para else line_no
            para.append(line)
        elif para:
            yield _paragraph(para, tok, vocab_size, f"{path}:{first}")
            para = []
    if para:
        yield _paragraph(para, tok, vocab_size, f"{path}:{first}")


def _paragraph(lines: list[str], tok, vocab_size: int, where: str) -> tuple[list[int], list[bool]]:
    """The ``(token_ids, loss_mask)`` of one paragraph, ended with EOS."""
    t = tok()
    ids = _in_vocab(_encode(t, "\n".join(lines).strip()) + _eos(t), vocab_size, where)
    return ids, [True] * len(ids)


def _text_lines(path: Path, progress=None) -> Iterator[tuple[int, str]]:
    """``(line_no, line)`` without its line end; ``\\r\\n`` and a lone ``\\r`` end lines too
    (as reading in text mode turns them), and count as lines."""
    line_no = 0
    for _, raw_line in _lines(path, progress):
        if "\r" in raw_line:
            raw_line = raw_line.replace("\r\n", "\n").replace("\r", "\n")
        parts = raw_line.split("\n")
        if raw_line.endswith("\n"):
            parts.pop()
        for part in parts:
            line_no += 1
            yield line_no, part
