"""The token cache: the same batches as tokenizing in memory, tokenized once per data, never
trusted when damaged or cut off by a kill, and a fallback where it cannot be written."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from polyaccel.moe import data as data_module
from polyaccel.moe import data_cache
from polyaccel.moe.data import Batches, MappedDataset, PackedDataset, build_dataset
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import DataConfig, load_config

TINY = Path(__file__).resolve().parents[2] / "packages/moe/examples/tiny_synthetic_cpu.yaml"
WORDS = "the cat sat on mat a dog ran what is two plus four six".split()


def _tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)
    return path


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _data(tmp_path: Path, kind: str) -> Path:
    """Documents of 1..40 words (``seq_len`` 8 below: many longer than a sample), an empty
    line / empty record among them."""
    rng = random.Random(0)
    f = tmp_path / f"d.{kind}"
    if kind == "text":
        paras = [_words(rng, rng.randint(1, 40)) for _ in range(30)]
        f.write_text("\n\n".join(paras[:10]) + "\n\n\n \t\n" + "\n\n".join(paras[10:]) + "\n")
    else:
        recs = [{"prompt": _words(rng, rng.randint(1, 12)), "completion": _words(rng, rng.randint(1, 30))}
                for _ in range(30)]
        recs.insert(7, {"prompt": "", "completion": " "})
        f.write_text("".join(json.dumps(r) + "\n" for r in recs[:12]) + "\n"
                     + "".join(json.dumps(r) + "\n" for r in recs[12:]))
    return f


def _build(f: Path, tok: Path, cache: Path | None, seq_len: int = 8, **kw):
    kind = "text" if f.suffix == ".text" else "jsonl"
    return build_dataset(DataConfig(**{kind: str(f)}, tokenizer=str(tok), **kw), seq_len=seq_len,
                         vocab_size=32, cache_dir=cache)


def _batches(src, steps: int = 12, dp: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for rank in range(dp):
        b = Batches(src, micro_batch=3, grad_accum=2, dp_rank=rank, dp_size=dp, seed=5)
        out += [(mb["input_ids"], mb["labels"]) for _ in range(steps) for mb in b.next_step()]
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.fixture
def settled(monkeypatch) -> None:
    """Data files count as settled at once (not ``SETTLE_S`` after their last change): their
    hash is remembered."""
    monkeypatch.setattr(data_cache, "SETTLE_S", 0.0)


@pytest.fixture
def reads(monkeypatch) -> dict[str, list]:
    """The files the cache hashes (``sha``: paths) and reads through for a CRC (``crc``: names)."""
    seen: dict[str, list] = {"sha": [], "crc": []}
    real_sha, real_crc = data_cache._sha256_of, data_cache.file_crc32

    def sha(f):
        seen["sha"].append(Path(f.name))
        return real_sha(f)

    def crc(f):
        seen["crc"].append(Path(f.name).name)
        return real_crc(f)

    monkeypatch.setattr(data_cache, "_sha256_of", sha)
    monkeypatch.setattr(data_cache, "file_crc32", crc)
    return seen


@pytest.fixture
def encodes(monkeypatch) -> list[int]:
    """Counts calls to the tokenizer (one per text / prompt / completion)."""
    calls: list[int] = []
    real = data_module._encode

    def counting(tokenizer, text):
        calls.append(1)
        return real(tokenizer, text)

    monkeypatch.setattr(data_module, "_encode", counting)
    return calls


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_the_cached_batches_are_exactly_those_tokenized_in_memory(tmp_path, kind):
    f, tok = _data(tmp_path, kind), _tokenizer(tmp_path / "tok")
    memory = _build(f, tok, None)
    mapped = _build(f, tok, tmp_path / "cache")
    assert isinstance(memory, PackedDataset) and isinstance(mapped, MappedDataset)
    assert len(mapped) == len(memory) > 30  # documents longer than a sample: many samples
    assert _same(_batches(mapped), _batches(memory))  # several epochs, two ranks, shuffled
    assert all(torch.equal(mapped.sample(i)[1], memory.sample(i)[1]) for i in range(len(memory)))
    if kind == "jsonl":  # the prompt is masked
        assert (memory.labels == -100).sum() > (memory.input_ids == 0).sum()


def test_a_second_run_maps_the_cache_without_tokenizing_even_at_another_seq_len(tmp_path, encodes, caplog):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    first = _batches(_build(f, tok, tmp_path / "cache"))
    assert len(encodes) == 60 and "skipped 1 empty records (lines 8)" in caplog.text
    caplog.clear()
    encodes.clear()
    again = _build(f, tok, tmp_path / "cache")
    assert encodes == [] and _same(_batches(again), first)
    assert "skipped 1 empty records (lines 8)" in caplog.text  # what reading the data said, said again
    assert encodes == [] and _same(_batches(_build(f, tok, tmp_path / "cache", seq_len=5)),
                                   _batches(_build(f, tok, None, seq_len=5)))
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name != "sources"]) == 2  # one cache and its lock file


def test_a_cache_is_read_without_its_lock(tmp_path, encodes):
    """A cache in a folder where no lock can be taken (copied read-only) is still used."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, tmp_path / "cache"))
    (lock,) = (tmp_path / "cache").glob("*.lock")
    lock.unlink()
    lock.mkdir()  # opening it to lock fails
    encodes.clear()
    got = _build(f, tok, tmp_path / "cache")
    assert isinstance(got, MappedDataset) and encodes == [] and _same(_batches(got), want)


@pytest.mark.parametrize("change", ["data", "tokenizer", "field", "vocab"])
def test_a_change_that_changes_the_tokens_builds_another_cache(tmp_path, encodes, change):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    _build(f, tok, tmp_path / "cache")
    encodes.clear()
    kw = {}
    if change == "data":
        f.write_text(f.read_text().replace("cat", "dog", 1))
    elif change == "tokenizer":
        (tok / "tokenizer_config.json").write_text((tok / "tokenizer_config.json").read_text().replace("{", '{"x": 1,', 1))
    elif change == "field":
        kw["field"] = "body"
    if change == "vocab":
        build_dataset(DataConfig(jsonl=str(f), tokenizer=str(tok)), seq_len=8, vocab_size=33,
                      cache_dir=tmp_path / "cache")
    else:
        _build(f, tok, tmp_path / "cache", **kw)
    assert len(encodes) > 0 and len(list((tmp_path / "cache").glob("*.lock"))) == 2


def _only_cache(root: Path) -> Path:
    (folder,) = _caches(root)
    return folder


def _caches(root: Path) -> list[Path]:
    """The cache folders in ``root`` (not ``sources/``, the memos of the data files' hashes)."""
    return [p for p in root.iterdir() if p.is_dir() and p.name != "sources"]


def _edit_meta(folder: Path, **changes) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps(meta | changes))


DAMAGE = {
    "truncated tokens": lambda d: os.truncate(d / "tokens.bin", 10),
    "flipped mask byte": lambda d: (d / "mask.bin").write_bytes(bytes([1 - (d / "mask.bin").read_bytes()[0]])
                                                                 + (d / "mask.bin").read_bytes()[1:]),
    "longer offsets": lambda d: (d / "offsets.bin").write_bytes((d / "offsets.bin").read_bytes() + bytes(8)),
    "meta not json": lambda d: (d / "meta.json").write_text('{"magic": "polyaccel-moe-tok'),
    "meta bad magic": lambda d: _edit_meta(d, magic="something"),
    "meta other key": lambda d: _edit_meta(d, key="0" * 32),
    "meta wrong count": lambda d: _edit_meta(d, tokens=5),
    "meta missing (a kill before it)": lambda d: (d / "meta.json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_rebuilt_never_trusted(tmp_path, encodes, caplog, damage):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, None))
    _build(f, tok, tmp_path / "cache")
    DAMAGE[damage](_only_cache(tmp_path / "cache"))
    encodes.clear()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        got = _batches(_build(f, tok, tmp_path / "cache"))
    assert len(encodes) > 0 and _same(got, want)
    assert len(re.findall(r"data cache .* is not usable \(.+\); rebuilding it", caplog.text)) == 1
    encodes.clear()
    assert _same(_batches(_build(f, tok, tmp_path / "cache")), want) and encodes == []  # the rebuilt one is used
    assert sorted(p.name.endswith(".lock") for p in (tmp_path / "cache").iterdir() if p.name != "sources") == [False, True]


_KILLED_BUILD = """
import sys, time
from pathlib import Path
from polyaccel.moe import data as data_module
from polyaccel.moe.data import build_dataset
from polyaccel.moe.train_config import DataConfig
real, calls = data_module._encode, []
def slow(tokenizer, text):
    calls.append(1)
    if len(calls) == 20:  # half way through: say so, then hang until killed
        Path(sys.argv[3]).write_text("building")
        time.sleep(600)
    return real(tokenizer, text)
data_module._encode = slow
build_dataset(DataConfig(text=sys.argv[1], tokenizer=sys.argv[2]), seq_len=8, vocab_size=32, cache_dir=sys.argv[4])
"""


def test_a_cache_build_killed_with_sigkill_leaves_nothing_that_is_used(tmp_path, encodes):
    f, tok, marker, cache = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok"), tmp_path / "marker", tmp_path / "cache"
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_BUILD, str(f), str(tok), str(marker), str(cache)], env=env)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        assert [p.name for p in cache.iterdir() if ".tmp-" in p.name]  # it was writing
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert not [p for p in _caches(cache) if ".tmp-" not in p.name]  # no cache under its key
    encodes.clear()
    got = _build(f, tok, cache)
    assert len(encodes) == 30 and _same(_batches(got), _batches(_build(f, tok, None)))
    assert [p.name for p in cache.iterdir() if ".tmp-" in p.name] == []  # the killed build's folder removed


def _three_ranks_at_once(f: Path, tok: Path, cache: Path) -> list:
    """The batches three threads get from ``_build`` started at the same moment (ranks of a job)."""
    start, results = threading.Barrier(3), []

    def rank():
        start.wait()
        results.append(_batches(_build(f, tok, cache)))

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and _same(results[0], results[1]) and _same(results[0], results[2])
    return results


def test_processes_started_together_tokenize_once(tmp_path, encodes):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    _three_ranks_at_once(f, tok, tmp_path / "cache")
    assert len(encodes) == 30


def test_a_cache_that_cannot_be_written_is_one_warning_and_the_data_is_tokenized_in_memory(tmp_path, caplog,
                                                                                           monkeypatch):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, None))
    (tmp_path / "file").write_text("not a folder")
    caplog.clear()
    got = _build(f, tok, tmp_path / "file" / "cache")
    assert isinstance(got, PackedDataset) and _same(_batches(got), want)
    lines = [r.getMessage() for r in caplog.records if "data cache" in r.getMessage()]
    assert len(lines) == 1 and f"cannot write {tmp_path / 'file' / 'cache'}" in lines[0] and "in memory" in lines[0]

    def full(self, name, array):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data_cache._Writer, "_write", full)
    caplog.clear()
    got = _build(f, tok, tmp_path / "new" / "cache")
    assert isinstance(got, PackedDataset) and _same(_batches(got), want)
    assert "No space left on device" in caplog.text and not (tmp_path / "new").exists()  # nothing left behind


def test_an_error_reading_the_data_while_building_is_a_data_error_not_a_cache_one(tmp_path, caplog, monkeypatch):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    real, calls = data_module._record, []

    def failing(line, path, line_no):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(line, path, line_no)

    monkeypatch.setattr(data_module, "_record", failing)
    with pytest.raises(data_module.ConfigError, match=rf"data\.jsonl: cannot read {re.escape(str(f))} \(Input/output"):
        _build(f, tok, tmp_path / "ck" / ".data_cache")
    assert "data cache" not in caplog.text and not (tmp_path / "ck").exists() and len(calls) == 3


@pytest.mark.parametrize("records,message", [
    ('{"text": "the cat"}\n{"body": "x"}\n', r":2: record has no 'text' field"),
    ('{"input_ids": [7]}\n', "has no token to train on"),
    ('{"text": " "}\n', "is empty"),
])
def test_refused_data_leaves_no_cache_folder(tmp_path, records, message, settled):
    f, tok = tmp_path / "d.jsonl", _tokenizer(tmp_path / "tok")
    f.write_text(records)
    for _ in range(2):
        with pytest.raises(data_module.ConfigError, match=message):
            _build(f, tok, tmp_path / "ck" / ".data_cache")
        assert not (tmp_path / "ck").exists()
    (tmp_path / "ck" / ".data_cache").mkdir(parents=True)  # folders that were there: kept, with no cache in them
    with pytest.raises(data_module.ConfigError, match=message):
        _build(f, tok, tmp_path / "ck" / ".data_cache")
    assert [p.name for p in (tmp_path / "ck").rglob("*") if not p.name.endswith(".lock")] == [".data_cache"]


def test_a_finetune_run_keeps_its_cache_in_checkpoint_dir_and_a_resume_does_not_tokenize(tmp_path, encodes):
    """Only in checkpoint.dir: output_dir stays unmade until the final save (a pre-empted run or
    a failed save leaves none), so a run without checkpoint.dir tokenizes in memory."""
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    sets = [f"data.tokenizer={tok}", f"data.jsonl={f}", f"checkpoint.dir={tmp_path / 'ck'}",
            f"output_dir={tmp_path / 'out'}", "log.progress_bar=false", "log.every_steps=1000", "train.seq_len=8"]
    finetune(load_config(TINY, [*sets, "train.max_steps=2"]))
    assert len(encodes) == 60 and (tmp_path / "ck" / ".data_cache").is_dir() and (tmp_path / "out").is_dir()
    assert not (tmp_path / "out" / ".data_cache").exists()
    encodes.clear()
    finetune(load_config(TINY, [*sets, "train.max_steps=3"]))
    assert encodes == []
    off = tmp_path / "off"
    finetune(load_config(TINY, [*sets[:2], f"checkpoint.dir={off}", f"output_dir={tmp_path / 'out2'}",
                                "data.cache=false", *sets[4:], "train.max_steps=1"]))
    assert len(encodes) == 60 and not (off / ".data_cache").exists()
    encodes.clear()
    finetune(load_config(TINY, [*sets[:2], f"output_dir={tmp_path / 'only'}", "checkpoint.dir=null", *sets[4:],
                                "train.max_steps=1"]))
    assert len(encodes) == 60 and not (tmp_path / "only" / ".data_cache").exists()


_COUNT_ENCODES = '''
import atexit, os
if "RANK" in os.environ:  # the ranks, not the torchrun launcher
    from polyaccel.moe import data as data_module
    real, calls = data_module._encode, []
    def counting(tokenizer, text):
        calls.append(1)
        return real(tokenizer, text)
    data_module._encode = counting
    atexit.register(lambda: open(os.environ["ENCODES"] + os.environ["RANK"], "w").write(str(len(calls))))
'''


@pytest.mark.slow
def test_under_torchrun_one_rank_tokenizes_and_both_train_on_the_cache(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_COUNT_ENCODES)
    sources = [repo / "packages" / p / "src" for p in ("core", "backend_cuda", "moe", "asr")]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", ENCODES=str(tmp_path / "encodes."),
               PYTHONPATH=os.pathsep.join(map(str, [site, *sources])))
    sets = [f"data.jsonl={f}", f"data.tokenizer={tok}", f"checkpoint.dir={tmp_path / 'ck'}",
            f"output_dir={tmp_path / 'out'}", "train.seq_len=8", "train.max_steps=2", "log.progress_bar=false"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "polyaccel.moe.cli", "finetune", str(TINY), *[a for s in sets for a in ("--set", s)]],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = sorted(int((tmp_path / f"encodes.{r}").read_text()) for r in (0, 1))
    assert counts == [0, 60]  # one rank tokenized, the other mapped its cache
    assert len(_caches(tmp_path / "ck" / ".data_cache")) == 1


@pytest.mark.parametrize("vocab,dtype", [(2**16, "uint16"), (2**16 + 1, "uint32"), (151936, "uint32")])
def test_token_ids_are_stored_in_the_narrowest_type_that_holds_the_vocabulary(tmp_path, vocab, dtype):
    f = tmp_path / "d.jsonl"
    ids = [0, 1, 255, 256, 65535, vocab - 1]
    f.write_text(json.dumps({"input_ids": ids}) + "\n" + json.dumps({"input_ids": ids[::-1]}) + "\n")
    cfg = DataConfig(jsonl=str(f))
    mapped = build_dataset(cfg, seq_len=4, vocab_size=vocab, cache_dir=tmp_path / "cache")
    memory = build_dataset(cfg, seq_len=4, vocab_size=vocab)
    assert json.loads((_only_cache(tmp_path / "cache") / "meta.json").read_text())["dtype"] == dtype
    assert _same(_batches(mapped, steps=3), _batches(memory, steps=3))
    assert mapped.sample(1)[0].tolist() == memory.sample(1)[0].tolist() == [256, 65535, vocab - 1, vocab - 1]


def test_building_shows_the_bytes_read_on_a_bar(tmp_path, monkeypatch):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    read: list[int] = []

    class Bar:
        def update(self, n):
            read.append(n)

    @contextlib.contextmanager
    def progress(source):
        assert source == f
        yield Bar()

    monkeypatch.setattr(data_cache, "_progress", progress)
    _build(f, tok, tmp_path / "cache")
    assert sum(read) == f.stat().st_size and len(read) > 30


# --------------------------------------------------------------------------------------------
# A start that finds the data and its cache unchanged reads neither through
# --------------------------------------------------------------------------------------------

def test_a_second_start_neither_hashes_the_data_nor_reads_the_cache_through(tmp_path, encodes, reads, settled,
                                                                             monkeypatch):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, tmp_path / "cache"))
    assert reads["sha"].count(f) == 1 and sorted(reads["crc"]) == sorted(data_cache.FILES)  # the build reads it back
    for seen in (*reads.values(), encodes):
        seen.clear()
    got = _batches(_build(f, tok, tmp_path / "cache"))
    assert f not in reads["sha"] and reads["crc"] == [] and encodes == [] and _same(got, want)
    monkeypatch.setenv(data_cache.VERIFY_ENV, "1")  # asks for both again
    got = _batches(_build(f, tok, tmp_path / "cache"))
    assert reads["sha"].count(f) == 1 and sorted(reads["crc"]) == sorted(data_cache.FILES) and encodes == []
    assert _same(got, want)


def _restore_times(path: Path, st: os.stat_result) -> None:
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


@pytest.mark.parametrize("how", ["edited in place", "replaced by a renamed file"])
def test_data_changed_with_its_size_and_mtime_kept_is_hashed_again(tmp_path, encodes, reads, settled, how):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    _build(f, tok, tmp_path / "cache")
    st, old = f.stat(), f.read_bytes()
    new = old.replace(b"cat", b"dog", 1)
    assert new != old
    if how == "edited in place":
        with f.open("r+b") as h:
            h.write(new)
    else:
        (tmp_path / "new").write_bytes(new)
        os.replace(tmp_path / "new", f)
    _restore_times(f, st)
    reads["sha"].clear()
    encodes.clear()
    got = _build(f, tok, tmp_path / "cache")
    assert reads["sha"].count(f) == 1 and len(encodes) > 0 and len(_caches(tmp_path / "cache")) == 2  # another key
    assert _same(_batches(got), _batches(_build(f, tok, None)))


def test_a_cache_file_changed_in_place_with_its_mtime_restored_is_caught(tmp_path, encodes, settled, caplog):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, None))
    _build(f, tok, tmp_path / "cache")
    tokens = _only_cache(tmp_path / "cache") / "tokens.bin"
    st = tokens.stat()
    with tokens.open("r+b") as h:
        first = h.read(1)[0]
        h.seek(0)
        h.write(bytes([first ^ 1]))
    _restore_times(tokens, st)
    encodes.clear()
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        got = _batches(_build(f, tok, tmp_path / "cache"))
    assert "(tokens.bin does not match its CRC-32); rebuilding it" in caplog.text
    assert len(encodes) > 0 and _same(got, want)


MEMOS = {  # what the memo of a file of path ``p`` and identity ``i`` is replaced with
    "not JSON": lambda p, i: b'{"path": ',
    "not text": lambda p, i: b"\xff\xfe\x00" * 7,
    "not an object": lambda p, i: json.dumps([{"path": p, "seen": [[i, "0" * 64]]}]).encode(),
    "for another path": lambda p, i: json.dumps({"path": "/elsewhere/d.jsonl", "seen": [[i, "0" * 64]]}).encode(),
    "for another identity": lambda p, i: json.dumps({"path": p, "seen": [[[1, 2, 3, 4, 5], "0" * 64]]}).encode(),
    "not a hash": lambda p, i: json.dumps({"path": p, "seen": [[i, "not a hash"]]}).encode(),
    "an identity of strings": lambda p, i: json.dumps({"path": p, "seen": [[list(map(str, i)), "0" * 64]]}).encode(),
}


@pytest.mark.parametrize("memo", MEMOS)
def test_a_memo_that_does_not_fit_is_ignored_and_rewritten(tmp_path, encodes, reads, settled, memo):
    f, tok = _data(tmp_path, "jsonl"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, tmp_path / "cache"))
    (path, _) = data_cache.memo_paths(tmp_path / "cache", f)
    entry = json.loads(path.read_bytes())
    assert entry == {"path": str(f), "seen": [[data_cache.identity(f.stat()), data_cache.file_sha256(f)]]}
    path.write_bytes(MEMOS[memo](str(f), data_cache.identity(f.stat())))
    reads["sha"].clear()
    encodes.clear()
    got = _batches(_build(f, tok, tmp_path / "cache"))
    assert reads["sha"].count(f) == 1 and encodes == [] and _same(got, want)  # hashed, and the same cache used
    again = json.loads(path.read_bytes())
    assert again["path"] == entry["path"] and again["seen"][-1] == entry["seen"][0]  # rewritten
    _build(f, tok, tmp_path / "cache")
    assert reads["sha"].count(f) == 1


def test_processes_started_together_hash_the_data_once(tmp_path, encodes, reads, settled, monkeypatch):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    counting = data_cache._sha256_of

    def slow(h):  # long enough for every thread to find no memo before the first is done
        time.sleep(0.3)
        return counting(h)

    monkeypatch.setattr(data_cache, "_sha256_of", slow)
    _three_ranks_at_once(f, tok, tmp_path / "cache")
    assert reads["sha"].count(f) == 1 and len(encodes) == 30


def test_a_data_file_changed_just_before_the_start_is_hashed_and_not_remembered(tmp_path, encodes, reads,
                                                                                monkeypatch):
    """A write in the same tick of the file system's clock could keep its times."""
    monkeypatch.setattr(data_cache, "SETTLE_S", 3600.0)
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    want = _batches(_build(f, tok, tmp_path / "cache"))
    encodes.clear()
    assert _same(_batches(_build(f, tok, tmp_path / "cache")), want) and encodes == []
    assert reads["sha"].count(f) == 2 and not (tmp_path / "cache" / "sources").exists()


def test_a_memo_that_cannot_be_written_costs_only_the_hash(tmp_path, encodes, reads, settled):
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "sources").write_text("not a folder")
    want = _batches(_build(f, tok, tmp_path / "cache"))
    encodes.clear()
    assert _same(_batches(_build(f, tok, tmp_path / "cache")), want) and encodes == []
    assert reads["sha"].count(f) == 2 and (tmp_path / "cache" / "sources").read_text() == "not a folder"


def test_nodes_that_see_the_data_under_other_devices_each_hash_it_once(tmp_path, encodes, reads, settled,
                                                                       monkeypatch):
    """A file system shared by several nodes may have another st_dev on each: the memo keeps both."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    real, node = data_cache.identity, [0]
    monkeypatch.setattr(data_cache, "identity", lambda st: [st.st_dev + node[0], *real(st)[1:]])
    for start in range(6):
        node[0] = start % 2
        _build(f, tok, tmp_path / "cache")
    assert reads["sha"].count(f) == 2 and len(encodes) == 30


def test_processes_that_waited_for_a_hash_that_left_no_memo_hash_side_by_side(tmp_path, encodes, reads, settled,
                                                                                monkeypatch):
    """A full disk: the first leaves no memo; the others must not then hash one behind the other."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    counting, running, most = data_cache._sha256_of, [0], [0]
    lock = threading.Lock()

    def slow(h):
        if Path(h.name) != f:  # a tokenizer file
            return counting(h)
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.5)
        with lock:
            running[0] -= 1
        return counting(h)

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data_cache, "_sha256_of", slow)
    monkeypatch.setattr(data_cache, "replace_file", full)
    start = threading.Barrier(3)

    def rank():
        start.wait()
        _build(f, tok, tmp_path / "cache")

    threads = [threading.Thread(target=rank) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads["sha"].count(f) == 3 and most[0] == 2  # the first alone, then the two that waited together


def test_a_link_planted_at_a_lock_file_is_never_followed(tmp_path, settled):
    """A symbolic link at ``<key>.lock`` or at the data file's hashing lock (someone else's, in a
    shared ``checkpoint.dir``) is not followed: no file appears where it points, and the run
    still gets the same batches (the data then tokenized in memory)."""
    f, tok = _data(tmp_path, "text"), _tokenizer(tmp_path / "tok")
    cache = tmp_path / "ckpt" / ".data_cache"
    want = _batches(_build(f, tok, cache))
    (key,) = [p.name for p in cache.iterdir() if p.is_dir() and p.name != "sources"]
    _, source_lock = data_cache.memo_paths(cache, f)
    shutil.rmtree(cache)
    (cache / "sources").mkdir(parents=True)
    targets = [tmp_path / "elsewhere-key", tmp_path / "elsewhere-source"]
    (cache / f"{key}.lock").symlink_to(targets[0])
    source_lock.symlink_to(targets[1])
    assert _same(_batches(_build(f, tok, cache)), want)
    assert not any(t.exists() for t in targets)
