"""The TorchNeuron compile path without the SDK: the error when torch-neuronx is missing,
the artifact environment, NEFF discovery, and compile_graph end to end against a stand-in
``neuron`` torch.compile backend that writes a NEFF where TorchNeuron would."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from polyaccel.core import GraphCache, GraphSpec, ShapeBuckets
from polyaccel.neuron import compile as ncompile
from polyaccel.neuron.plugin import NeuronBackend, visible_cores


def test_missing_torch_neuronx_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_neuronx", None)
    with pytest.raises(ImportError, match="torch-neuronx"):
        ncompile.compile_graph(lambda x: x + 1, [torch.zeros(2)], "g")
    with pytest.raises(ImportError, match="torch-neuronx"):
        NeuronBackend().replica_devices(8)


def test_compile_env_is_set_and_restored(tmp_path, monkeypatch):
    monkeypatch.delenv(ncompile.PRESERVE_ENV, raising=False)
    monkeypatch.setenv(ncompile.DEBUG_DIR_ENV, "/previous")
    with ncompile.neuron_compile_env(tmp_path) as env:
        assert os.environ[ncompile.PRESERVE_ENV] == "1"
        assert os.environ[ncompile.DEBUG_DIR_ENV] == str(tmp_path) == env[ncompile.DEBUG_DIR_ENV]
    assert ncompile.PRESERVE_ENV not in os.environ
    assert os.environ[ncompile.DEBUG_DIR_ENV] == "/previous"


def test_graph_dir_names_and_neff_discovery(tmp_path):
    assert ncompile.graph_dir_name("encode{'batch': 8, 'frames': 3000}") == "encode-batch8-frames3000"
    assert ncompile.graph_dir_name("decode_step{'batch': 16}") == "decode_step-batch16"
    enc = tmp_path / "encode-batch8"
    (enc / "sub" / "deeper").mkdir(parents=True)
    (enc / "sub" / "model.neff").write_bytes(b"a")
    (enc / "sub" / "deeper" / "graph.neff").write_bytes(b"b")
    (enc / "sub" / "model.hlo").write_bytes(b"not a neff")
    (enc / ncompile.MARKER).write_text("encode{'batch': 8}\n")  # compile_graph wrote it
    (tmp_path / "empty").mkdir()
    (tmp_path / "planted").mkdir()  # NEFFs in a folder compile_graph did not write are not listed
    (tmp_path / "planted" / "model.neff").write_bytes(b"c")
    assert {p.name for p in ncompile.find_neffs(enc)} == {"model.neff", "graph.neff"}
    assert ncompile.find_neffs(tmp_path / "missing") == []
    found = ncompile.collect_neffs(tmp_path)
    assert list(found) == ["encode-batch8"] and len(found["encode-batch8"]) == 2


@pytest.fixture
def fake_torch_neuronx(monkeypatch):
    """A ``torch_neuronx`` module and a ``neuron`` dynamo backend that, like TorchNeuron with
    artifacts preserved, writes one NEFF per compiled graph into TORCH_NEURONX_DEBUG_DIR."""
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    from torch._dynamo import list_backends, register_backend

    if "neuron" not in list_backends(exclude_tags=()):
        def fake_neuron_backend(gm, example_inputs):
            if os.environ.get(ncompile.PRESERVE_ENV) == "1":
                out = os.path.join(os.environ[ncompile.DEBUG_DIR_ENV], "neuronxcc-0")
                os.makedirs(out, exist_ok=True)
                shapes = "-".join("x".join(map(str, t.shape)) for t in example_inputs)
                with open(os.path.join(out, f"graph-{shapes}.neff"), "wb") as f:
                    f.write(b"NEFF")
            return gm.forward

        register_backend(compiler_fn=fake_neuron_backend, name="neuron")


def test_encoder_and_decoder_compile_to_separate_neffs_per_bucket(fake_torch_neuronx, tmp_path, monkeypatch):
    monkeypatch.setenv(ncompile.ARTIFACTS_ENV, str(tmp_path))
    w = torch.randn(4, 4)
    specs = [
        GraphSpec("encode", lambda x: torch.tanh(x @ w), ShapeBuckets({"batch": (1, 2)}),
                  lambda b: [torch.randn(b["batch"], 3, 4)]),
        GraphSpec("decode_step", lambda y: torch.relu(y @ w.T), ShapeBuckets({"batch": (2,)}),
                  lambda b: [torch.randn(b["batch"], 4)]),
    ]
    cache = GraphCache(NeuronBackend(), specs)
    assert cache.warmup() == 3
    found = ncompile.collect_neffs(tmp_path)
    assert sorted(k.rsplit("-", 1)[0] for k in found) == ["decode_step-batch2", "encode-batch1", "encode-batch2"]
    assert all(len(v) == 1 for v in found.values())
    enc = cache.get("encode", {"batch": 2})
    assert isinstance(enc, ncompile.CompiledGraph) and enc.neffs == found[enc.artifacts_dir.name]
    assert ncompile.collect_neffs(tmp_path, example_inputs=[torch.randn(2, 3, 4)]) == {enc.artifacts_dir.name: enc.neffs}
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(enc(x), torch.tanh(x @ w))
    assert ncompile.PRESERVE_ENV not in os.environ


def test_replica_cores_follow_visible_cores(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-15")
    assert visible_cores(0) == list(range(8, 16))  # absolute ids; libnrt calls them 0..7
    assert NeuronBackend().replica_cores(10, share=True) == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4,5-6")
    assert visible_cores(0) == [4, 5, 6]
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    assert visible_cores(8) == list(range(8))


def _fake_compile(monkeypatch, payload):
    """torch.compile stand-in: the compiled call writes ``payload()`` as a NEFF into
    TORCH_NEURONX_DEBUG_DIR (raising if payload raises, after a partial write)."""
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))

    def compile_(fn, **kw):
        def run(*xs):
            with open(os.path.join(os.environ[ncompile.DEBUG_DIR_ENV], "graph.neff"), "wb") as f:
                f.write(b"NE")  # partial until payload() returns
                f.write(payload())
            return fn(*xs)
        return run

    monkeypatch.setattr(ncompile.torch, "compile", compile_)


def test_killed_compile_leaves_no_neff_that_is_trusted_later(tmp_path, monkeypatch):
    def killed():
        raise KeyboardInterrupt  # the process is interrupted mid-write

    _fake_compile(monkeypatch, killed)
    with pytest.raises(KeyboardInterrupt):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path)
    assert ncompile.collect_neffs(tmp_path) == {}
    _fake_compile(monkeypatch, lambda: b"FF-v2")
    g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path)
    assert [p.read_bytes() for p in g.neffs] == [b"NEFF-v2"]
    # a recompile replaces the earlier NEFFs instead of listing both
    (g.artifacts_dir / "sub").mkdir()
    (g.artifacts_dir / "sub" / "stale.neff").write_bytes(b"old")
    g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path)
    assert [p.name for p in g.neffs] == ["graph.neff"]
    assert ncompile.collect_neffs(tmp_path) == {g.artifacts_dir.name: g.neffs}
    name = ncompile.graph_dir_name("encode", g.key)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{name}.lock", name]  # no tmp or old folder left


def test_compile_does_not_replace_a_folder_it_did_not_write(tmp_path, monkeypatch):
    _fake_compile(monkeypatch, lambda: b"FF")
    notes = tmp_path / ncompile.graph_dir_name("notes", ncompile.graph_key([torch.zeros(1)]))
    notes.mkdir()
    (notes / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not written by compile_graph"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "notes", root=tmp_path)
    assert (notes / "mine.txt").read_text() == "keep"


def test_two_graph_names_on_one_directory_never_replace_each_other(tmp_path, monkeypatch):
    """"encode.v2" and "encode v2" both map to encode-v2: the second compile replaced the first
    graph's NEFFs, and the first CompiledGraph then listed the second graph's NEFF."""
    a, b = "encode.v2", "encode v2"
    assert ncompile.graph_dir_name(a) == ncompile.graph_dir_name(b)
    _fake_compile(monkeypatch, lambda: b"FF-minus")
    g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], a, root=tmp_path)
    _fake_compile(monkeypatch, lambda: b"FF-plus")
    with pytest.raises(FileExistsError, match="holds the NEFFs of graph"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], b, root=tmp_path)
    assert [p.read_bytes() for p in g.neffs] == [b"NEFF-minus"]
    again = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], a, root=tmp_path)
    assert [p.read_bytes() for p in again.neffs] == [b"NEFF-plus"]  # the same graph recompiles


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_an_artifacts_root_others_can_write_is_refused(tmp_path, monkeypatch, mode):
    """A root such as /tmp/neffs (world- or group-writable) let another user plant a graph
    directory with their NEFF, which collect_neffs handed to the runtime."""
    _fake_compile(monkeypatch, lambda: b"FF")
    root = tmp_path / "shared"
    root.mkdir()
    g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=root)
    root.chmod(mode)
    with pytest.raises(PermissionError, match="not writable by others"):
        ncompile.collect_neffs(root)
    with pytest.raises(PermissionError, match="not writable by others"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=root)
    root.chmod(0o700)
    assert list(ncompile.collect_neffs(root)) == [g.artifacts_dir.name]


def test_graph_directories_of_another_user_are_not_collected(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a folder to another user")
    _fake_compile(monkeypatch, lambda: b"FF")
    g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path)
    other = tmp_path / "decode"
    other.mkdir()
    (other / ncompile.MARKER).write_text("decode\n")
    (other / "graph.neff").write_bytes(b"NEFF-theirs")
    os.chown(other, 65534, 65534)
    assert list(ncompile.collect_neffs(tmp_path)) == [g.artifacts_dir.name]
    os.chown(tmp_path, 65534, 65534)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        ncompile.collect_neffs(tmp_path)
    os.chown(tmp_path, 0, 0)


def test_a_fresh_artifacts_root_is_private_whatever_the_umask(tmp_path, monkeypatch):
    _fake_compile(monkeypatch, lambda: b"FF")
    old = os.umask(0o002)
    try:
        g = ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path / "new")
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o077 == 0 and g.neffs


@pytest.mark.parametrize("spec,match", [
    ("0-3,2", "names a core twice"),  # core 2 got two replicas of a 5-replica pool
    ("7-0", "ascending range"),  # parsed as no core at all: replica_cores divided by zero
    ("0-", "ascending range"),
    ("a", "ascending range"),
    ("0,2-3", "contiguous"),  # the runtime refuses gaps
    ("5,0-3", "contiguous"),
])
def test_bad_visible_cores_are_refused(monkeypatch, spec, match):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", spec)
    with pytest.raises(ValueError, match=match):
        NeuronBackend().replica_cores(5)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", " 3-6 , 7 ")
    assert NeuronBackend().replica_cores(5) == [0, 1, 2, 3, 4]  # libnrt's indices of cores 3-7


def _neff_bytes(found: dict[str, list]) -> list[list[bytes]]:
    return [[p.read_bytes() for p in neffs] for neffs in found.values()]


def test_compiles_for_other_dtypes_shapes_or_compilers_keep_their_own_neffs(tmp_path, monkeypatch):
    """A graph's folder was named after the graph only: an fp32 compile of "encode" replaced its
    bf16 NEFF, and collect_neffs() in a later process handed out whichever compiled last."""
    bf16_in, fp32_in, wide_in = [torch.zeros(2, 3, dtype=torch.bfloat16)], [torch.zeros(2, 3)], [torch.zeros(4, 3)]
    graphs = {}
    for tag, inputs in [(b"bf16", bf16_in), (b"fp32", fp32_in), (b"4x3", wide_in)]:
        _fake_compile(monkeypatch, lambda tag=tag: b"FF-" + tag)
        graphs[tag] = ncompile.compile_graph(lambda x: x, inputs, "encode", root=tmp_path)
    assert len({g.artifacts_dir for g in graphs.values()}) == 3
    assert [p.read_bytes() for p in graphs[b"bf16"].neffs] == [b"NEFF-bf16"]  # not replaced by fp32
    assert _neff_bytes(ncompile.collect_neffs(tmp_path, name="encode", example_inputs=bf16_in)) == [[b"NEFF-bf16"]]
    assert _neff_bytes(ncompile.collect_neffs(tmp_path, example_inputs=fp32_in)) == [[b"NEFF-fp32"]]
    assert _neff_bytes(ncompile.collect_neffs(tmp_path, example_inputs=wide_in)) == [[b"NEFF-4x3"]]
    assert ncompile.collect_neffs(tmp_path, name="decode", example_inputs=fp32_in) == {}
    assert len(ncompile.collect_neffs(tmp_path, name="encode")) == 3
    monkeypatch.setenv(ncompile.LNC_ENV, "2")  # NEFFs compiled for another LNC do not match
    assert ncompile.collect_neffs(tmp_path, example_inputs=fp32_in) == {}
    monkeypatch.delenv(ncompile.LNC_ENV)
    monkeypatch.setattr(ncompile, "compiler_versions", lambda: {"neuronx-cc": "99.0"})  # another compiler
    assert ncompile.collect_neffs(tmp_path, example_inputs=fp32_in) == {}


def _racing_compile(root: str, tag: bytes, compile_s: float, hold_s: float, started, results) -> None:
    """In a child process: compile "encode" into ``root`` with a fake compiler that takes
    ``compile_s`` and writes a NEFF saying ``tag``; every NEFF listing takes ``hold_s`` (a slow
    disk), then report the bytes the returned ``neffs`` hold."""
    try:
        sys.modules["torch_neuronx"] = types.ModuleType("torch_neuronx")

        def compile_(fn, **kw):
            def run(*xs):
                started.set()
                time.sleep(compile_s)
                with open(os.path.join(os.environ[ncompile.DEBUG_DIR_ENV], "graph.neff"), "wb") as f:
                    f.write(tag)
                return fn(*xs)
            return run

        list_neffs = ncompile.find_neffs

        def slow_find_neffs(directory):
            time.sleep(hold_s)
            return list_neffs(directory)

        ncompile.torch.compile = compile_
        ncompile.find_neffs = slow_find_neffs
        g = ncompile.compile_graph(lambda x: x, [torch.zeros(2)], "encode", root=Path(root))
        results.put((tag, [p.read_bytes() for p in g.neffs]))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.put((tag, repr(e)))


def test_two_processes_compiling_one_graph_each_get_their_own_neffs(tmp_path):
    """Nothing kept two processes compiling the same graph into one root apart: B swapped its
    folder in while A was still listing its own, and A's CompiledGraph.neffs held B's NEFF."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    a_started, b_started = ctx.Event(), ctx.Event()
    a = ctx.Process(target=_racing_compile, args=(str(tmp_path), b"NEFF-A", 0.0, 1.0, a_started, results))
    b = ctx.Process(target=_racing_compile, args=(str(tmp_path), b"NEFF-B", 0.5, 0.0, b_started, results))
    a.start()
    assert a_started.wait(30)
    b.start()
    got = dict(results.get(timeout=60) for _ in range(2))
    a.join(30)
    b.join(30)
    assert got == {b"NEFF-A": [b"NEFF-A"], b"NEFF-B": [b"NEFF-B"]}
    assert _neff_bytes(ncompile.collect_neffs(tmp_path)) == [[b"NEFF-B"]]  # the later compile


def test_the_compile_lock_never_follows_a_symlink(tmp_path, monkeypatch):
    _fake_compile(monkeypatch, lambda: b"FF")
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep")
    name = ncompile.graph_dir_name("encode", ncompile.graph_key([torch.zeros(1)]))
    (root / f".{name}.lock").symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="symlink"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=root)
    assert elsewhere.read_text() == "keep" and ncompile.collect_neffs(root) == {}
