"""The data pipeline as a user relies on it: every target token trained exactly once per epoch
over all ranks, exact mid-epoch resume, deterministic reshuffles, SFT labels, odd inputs."""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

from polyaccel.moe import data as data_module
from polyaccel.moe.data import IGNORE_INDEX, Batches, PackedDataset, SyntheticDataset, build_dataset
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import ConfigError, DataConfig, load_config

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"


def _docs(n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    """``n`` documents of 1..9 tokens; every token id is unique (so counts identify tokens)."""
    g = torch.Generator().manual_seed(seed)
    out, next_id = [], 0
    for _ in range(n):
        length = int(torch.randint(1, 10, (1,), generator=g))
        out.append((list(range(next_id, next_id + length)), [True] * length))
        next_id += length
    return out


def _targets(batches: list[Batches], steps: int) -> Counter:
    """Token ids taken as loss targets (the model shifts labels: position 0 never is one)."""
    seen: Counter = Counter()
    for _ in range(steps):
        for b in batches:
            for mb in b.next_step():
                labels = mb["labels"][:, 1:]
                seen.update(labels[labels != IGNORE_INDEX].tolist())
    return seen


@pytest.mark.parametrize("n_docs,seq_len,world,micro,accum", [
    (13, 5, 1, 1, 1), (13, 5, 2, 1, 1), (29, 7, 3, 2, 1), (17, 4, 5, 1, 2), (40, 6, 8, 1, 3), (7, 16, 6, 2, 2)])
def test_every_target_token_is_trained_exactly_once_per_epoch_over_all_ranks(n_docs, seq_len, world, micro, accum):
    docs = _docs(n_docs)
    src = PackedDataset.pack(docs, seq_len=seq_len)
    ranks = [Batches(src, micro_batch=micro, grad_accum=accum, dp_rank=r, dp_size=world, seed=1)
             for r in range(world)]
    per_step = ranks[0].samples_per_step
    steps = len(src) // math.gcd(len(src), per_step)  # a whole number of epochs
    epochs = steps * per_step // len(src)
    tokens = [t for ids, _ in docs for t in ids]
    want = Counter({t: epochs for t in tokens[1:]})  # the very first token has nothing before it
    assert _targets(ranks, steps) == want


def test_a_completion_at_a_sample_boundary_is_still_trained():
    """A one-token completion landing on the first position of a sample is a target."""
    prompt, completion = [5, 6, 7, 8], [9, 1]
    src = PackedDataset.pack([(prompt + completion, [False] * 4 + [True] * 2)], seq_len=4)
    targets = _targets([Batches(src, micro_batch=1, grad_accum=1, shuffle=False)], len(src))
    assert targets == Counter({9: 1, 1: 1})


def test_sequence_length_one_is_refused():
    with pytest.raises(ConfigError, match="seq_len"):
        PackedDataset.pack([([1, 2, 3], [True] * 3)], seq_len=1)


def test_resume_mid_epoch_continues_with_the_next_samples_whatever_the_batch_shape():
    src = PackedDataset.pack(_docs(23), seq_len=5)
    straight = Batches(src, micro_batch=2, grad_accum=1, dp_size=1, seed=3)
    order = [mb["input_ids"] for _ in range(9) for mb in straight.next_step()]  # 18 samples, > 1 epoch
    first = Batches(src, micro_batch=2, grad_accum=1, seed=3)
    first.next_step(), first.next_step()
    state = first.state_dict()
    # Resumed on 2 ranks with another micro-batch: together they continue at sample 4.
    ranks = [Batches(src, micro_batch=1, grad_accum=1, dp_rank=r, dp_size=2, seed=3) for r in range(2)]
    for b in ranks:
        b.load_state_dict(state)
    for i in range(2, 9):
        got = torch.cat([b.next_step()[0]["input_ids"] for b in ranks])
        assert torch.equal(got, order[i]), i


def test_a_resumed_run_with_more_max_steps_trains_on_the_next_samples(tmp_path, monkeypatch):
    """End to end: stop after 2 of 4 steps, resume with max_steps=5; the samples of steps 3..5
    are the ones a straight run takes next (mid-epoch and across the epoch boundary)."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": [(9 * d + k) % 97 for k in range(9)]}) + "\n"
                            for d in range(44)))  # 396 tokens: 13 samples of 32, 4 per step
    seen: list[torch.Tensor] = []
    next_step = data_module.Batches.next_step

    def recording(self):
        out = next_step(self)
        seen.extend(mb["input_ids"] for mb in out)
        return out

    monkeypatch.setattr(data_module.Batches, "next_step", recording)
    sets = [f"data.jsonl={data}", f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every_steps=1",
            "log.progress_bar=false", "log.every_steps=1000", "output_dir=null"]
    finetune(load_config(TINY, [*sets, "train.max_steps=4"]), stop_after=2)
    cfg = load_config(TINY, [*sets, "train.max_steps=5"])
    finetune(cfg)
    got, t = list(seen), cfg.train
    src = build_dataset(cfg.data, seq_len=t.seq_len, vocab_size=97)
    straight = Batches(src, micro_batch=t.micro_batch, grad_accum=t.grad_accum, seed=t.seed)
    want = [mb["input_ids"] for _ in range(5) for mb in straight.next_step()]
    assert 2 * t.micro_batch * t.grad_accum < len(src) < 5 * t.micro_batch * t.grad_accum
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("change", ["seq_len", "data", "shuffle"])
def test_resuming_over_other_samples_is_refused(change):
    docs = _docs(23)
    src = PackedDataset.pack(docs, seq_len=5)
    state = Batches(src, micro_batch=2, grad_accum=1, seed=3).state_dict()
    other, shuffle = src, True
    if change == "seq_len":
        other = PackedDataset.pack(docs, seq_len=6)
    elif change == "data":
        other = PackedDataset.pack(docs + _docs(3, seed=1), seq_len=5)
    else:
        shuffle = False
    with pytest.raises(ValueError, match="samples|shuffle"):
        Batches(other, micro_batch=2, grad_accum=1, seed=3, shuffle=shuffle).load_state_dict(state)
    # A checkpoint written before these were recorded still loads.
    Batches(other, micro_batch=2, grad_accum=1, seed=3, shuffle=shuffle).load_state_dict({"position": 4, "seed": 3})


def test_each_epoch_is_a_new_permutation_fixed_by_the_seed():
    src = PackedDataset.pack(_docs(30), seq_len=4)
    n = len(src)

    def epochs(seed: int) -> list[list[int]]:
        b = Batches(src, micro_batch=1, grad_accum=1, seed=seed)
        return [[b.global_index(e * n + j) for j in range(n)] for e in range(3)]

    a = epochs(5)
    assert all(sorted(e) == list(range(n)) for e in a)
    assert a[0] != a[1] != a[2] and a == epochs(5) and a != epochs(6)


def test_a_large_seed_shuffles_and_synthesizes_instead_of_crashing_at_the_first_step():
    src = PackedDataset.pack(_docs(10), seq_len=4)
    b = Batches(src, micro_batch=2, grad_accum=1, seed=2**61)
    assert sorted(b.global_index(j) for j in range(len(src))) == list(range(len(src)))
    assert b.next_step()[0]["input_ids"].shape == (2, 4)
    assert SyntheticDataset(vocab=10, seq_len=4, seed=2**61).sample(3)[0].shape == (4,)


# --------------------------------------------------------------------------------------------
# Records and files
# --------------------------------------------------------------------------------------------

def _word_tokenizer(path: Path, eos: bool = True) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the cat sat on mat a dog ran what is two plus four six".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>" if eos else None, pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def _build(tmp_path: Path, kind: str, content: str | bytes, **kw) -> PackedDataset:
    f = tmp_path / f"data.{kind}"
    f.write_bytes(content.encode() if isinstance(content, str) else content)
    tok = kw.pop("tokenizer", None) or _word_tokenizer(tmp_path / "tok")
    return build_dataset(DataConfig(**{kind: str(f)}, tokenizer=str(tok), **kw), seq_len=32, vocab_size=32)


def _stream(ds: PackedDataset) -> list[int]:
    """The packed token stream, without the one-token overlap and the padding."""
    ids = [ds.input_ids[0, 0].item()] + ds.input_ids[:, 1:].flatten().tolist()
    kept = [ds.labels[0, 0].item()] + ds.labels[:, 1:].flatten().tolist()
    last = max(i for i, t in enumerate(kept) if t != IGNORE_INDEX)
    return ids[:last + 1]


def _lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_empty_and_whitespace_only_text_records_are_skipped_not_trained_as_a_lone_eos(tmp_path, caplog):
    ds = _build(tmp_path, "jsonl", _lines({"text": "the cat"}, {"text": ""}, {"text": " \n\t"}, {"text": "a dog"}))
    assert _stream(ds) == [3, 4, 1, 8, 9, 1]
    assert "skipped 2 empty records" in caplog.text


def test_whitespace_only_lines_separate_text_documents(tmp_path):
    ds = _build(tmp_path, "text", "the cat\n  \t\nsat on\r\n\r\na dog\n\n\n")
    assert _stream(ds) == [3, 4, 1, 5, 6, 1, 8, 9, 1]


def test_a_utf8_byte_order_mark_is_not_part_of_the_data(tmp_path):
    assert _stream(_build(tmp_path, "jsonl", b"\xef\xbb\xbf" + _lines({"text": "the cat"}).encode())) == [3, 4, 1]
    assert _stream(_build(tmp_path, "text", b"\xef\xbb\xbfthe cat")) == [3, 4, 1]


def test_pretokenized_labels_mask_the_loss(tmp_path):
    ds = _build(tmp_path, "jsonl", _lines({"input_ids": [10, 11, 12, 13], "labels": [-100, -100, 12, 13]}))
    assert ds.input_ids[0, :4].tolist() == [10, 11, 12, 13]
    assert ds.labels[0, :4].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 12, 13]


@pytest.mark.parametrize("labels,message", [
    ([-100, 12], "labels has 2 entries, input_ids 3"),
    ([-100, 5, 12], r"labels\[1\] = 5 is neither -100 nor input_ids\[1\]"),
    ("x", "labels must be a list"),
])
def test_bad_pretokenized_labels_are_refused(tmp_path, labels, message):
    with pytest.raises(ConfigError, match=message):
        _build(tmp_path, "jsonl", _lines({"input_ids": [10, 11, 12], "labels": labels}))


def test_a_tokenizer_without_eos_is_refused(tmp_path):
    tok = _word_tokenizer(tmp_path / "noeos", eos=False)
    with pytest.raises(ConfigError, match="no eos_token"):
        _build(tmp_path, "jsonl", _lines({"text": "the cat"}), tokenizer=tok)


def test_an_empty_file_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.jsonl.*empty"):
        _build(tmp_path, "jsonl", "\n \n")


def test_long_documents_are_split_across_samples_never_truncated(tmp_path):
    words = "the cat sat on a mat " * 50
    ds = _build(tmp_path, "text", words)
    assert _stream(ds) == [3, 4, 5, 6, 8, 7] * 50 + [1]


@pytest.mark.parametrize("content,where", [
    (b"the cat\n\nsat on\na \xfe dog\n", ":4: not UTF-8 text (invalid start byte at byte 2 of the line)"),
    (b"\xef\xbb\xbfthe cat \xff\n", ":1: not UTF-8 text (invalid start byte at byte 8 of the line)"),
    (b"the cat\r\n\r\nsat\r\n\xe9\n", ":4: not UTF-8 text"),
])
def test_a_text_file_that_is_not_utf8_is_refused_naming_its_line(tmp_path, content, where):
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'data.text'}{where}")):
        _build(tmp_path, "text", content)


def test_a_document_longer_than_the_tokenizers_max_length_packs_without_a_false_warning(tmp_path, caplog):
    tok = _word_tokenizer(tmp_path / "tok")
    cfg_path = tok / "tokenizer_config.json"
    cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | {"model_max_length": 8}))
    ds = _build(tmp_path, "jsonl", _lines({"text": "the cat sat on a mat " * 50}), tokenizer=tok)
    assert _stream(ds) == [3, 4, 5, 6, 8, 7] * 50 + [1]  # packed whole, not truncated
    assert "indexing errors" not in caplog.text  # Transformers' warning: never true here


def test_a_model_folder_without_tokenizer_files_is_refused_not_trained_as_eos_only(tmp_path, saved):
    """Transformers builds an empty tokenizer from ``config.json`` alone: every text became one
    EOS and such a run trained and exited 0."""
    with pytest.raises(ConfigError, match=f"{saved}: it holds no tokenizer files"):
        _build(tmp_path, "jsonl", _lines({"text": "the cat"}, {"text": "a dog"}), tokenizer=saved)


def test_a_tokenizer_without_its_vocabulary_is_refused(tmp_path, saved):
    tok = tmp_path / "cfg_only"
    tok.mkdir()
    (tok / "config.json").write_bytes((saved / "config.json").read_bytes())
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "</s>"}))
    with pytest.raises(ConfigError, match="its vocabulary is empty"):
        _build(tmp_path, "jsonl", _lines({"text": "the cat"}, {"text": "a dog"}), tokenizer=tok)


@pytest.mark.parametrize("kind,content,line", [
    ("jsonl", _lines({"text": "the cat"}) + "\n" + _lines({"text": ""}, {"prompt": "a", "completion": "cat"},
                                                          {"text": "sat big"}), 5),
    ("jsonl", _lines({"text": "the cat"}, {"prompt": "big", "completion": "cat"}), 2),
    ("text", "the cat\n\n \n\nsat on\nbig dog\n", 5),
])
def test_a_tokenizer_giving_ids_outside_the_vocabulary_is_named_by_file_and_line(tmp_path, kind, content, line):
    """A mismatched tokenizer: the error named the n-th document, which is not the n-th line
    once blank lines or skipped records come before it."""
    f = tmp_path / f"data.{kind}"
    f.write_text(content)
    tok = _word_tokenizer(tmp_path / "tok")
    tok_json = tok / "tokenizer.json"
    spec = json.loads(tok_json.read_text())
    spec["model"]["vocab"]["big"] = 40  # past the model's 32
    tok_json.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=re.escape(f"{f}:{line}: the tokenizer gave token id 40, outside")):
        build_dataset(DataConfig(**{kind: str(f)}, tokenizer=str(tok)), seq_len=32, vocab_size=32)


@pytest.mark.parametrize("record,message", [
    ({"prompt": "the"}, ":2: record has 'prompt' without 'completion' (nor a 'text' field); keys: prompt"),
    ({"completion": "cat", "id": 3}, ":2: record has 'completion' without 'prompt' (nor a 'text' field); keys: completion, id"),
    ({"body": "cat"}, ":2: record has no 'text' field (nor prompt/completion or input_ids); keys: body"),
])
def test_a_record_missing_a_field_is_named_with_what_it_lacks(tmp_path, record, message):
    with pytest.raises(ConfigError, match=re.escape(f"data.jsonl{message}")):
        _build(tmp_path, "jsonl", _lines({"prompt": "a", "completion": "cat"}, record))


@pytest.mark.parametrize("content", ['[\n  {"text": "the cat"}\n]\n', '{\n  "text": "the cat"\n}\n'])
def test_a_pretty_printed_json_file_given_as_jsonl_says_so(tmp_path, content):
    with pytest.raises(ConfigError, match=r"data\.jsonl:1: not valid JSON .*one whole JSON object per line"):
        _build(tmp_path, "jsonl", content)


def _paragraphs_before(text: str) -> list[tuple[int, str]]:
    """The paragraphs (first line, text) as the whole-file reader found them."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out, start, line, counted = [], 0, 1, 0
    for gap in [*re.finditer(r"\n[^\S\n]*\n", text), None]:
        end = gap.start() if gap else len(text)
        para = text[start:end]
        if para.strip():
            first = start + len(para) - len(para.lstrip())
            line, counted = line + text.count("\n", counted, first), first
            out.append((line, para.strip()))
        start = gap.end() if gap else end
    return out


def test_text_read_line_by_line_gives_the_paragraphs_the_whole_file_reader_gave(tmp_path, monkeypatch):
    """Paragraphs, their text and first line, as reading the whole file found them (CR, CRLF,
    blank lines of any whitespace, whitespace that is no line end)."""
    rng = random.Random(1)
    f = tmp_path / "t.text"
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(data_module, "_paragraph",
                        lambda lines, tok, vocab_size, where: seen.append((where, "\n".join(lines).strip())))
    for _ in range(300):
        text = "".join(rng.choice(["a", "b c", " ", "\t", "\n", "\n", "\r", "\r\n", "\x0b", "\u00a0", "\x1c"])
                       for _ in range(rng.randint(0, 30)))
        f.write_text(text, newline="")
        seen.clear()
        list(data_module._text_documents(f, lambda: None, 32))
        assert seen == [(f"{f}:{line}", para) for line, para in _paragraphs_before(text)], repr(text)
