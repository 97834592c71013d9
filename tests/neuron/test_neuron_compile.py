"""The TorchNeuron compile path without the SDK: the error when torch-neuronx is missing,
the artifact environment, NEFF discovery, and compile_graph end to end against a stand-in
``neuron`` torch.compile backend that writes a NEFF where TorchNeuron would."""

from __future__ import annotations

import os
import sys
import types

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
    assert sorted(found) == ["decode_step-batch2", "encode-batch1", "encode-batch2"]
    assert all(len(v) == 1 for v in found.values())
    enc = cache.get("encode", {"batch": 2})
    assert isinstance(enc, ncompile.CompiledGraph) and enc.neffs == found["encode-batch2"]
    x = torch.randn(2, 3, 4)
    torch.testing.assert_close(enc(x), torch.tanh(x @ w))
    assert ncompile.PRESERVE_ENV not in os.environ


def test_replica_cores_follow_visible_cores(monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "8-15")
    assert visible_cores(0) == list(range(8, 16))
    assert NeuronBackend().replica_cores(10) == [8, 9, 10, 11, 12, 13, 14, 15, 8, 9]
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0,2-3")
    assert visible_cores(0) == [0, 2, 3]
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
    assert ncompile.collect_neffs(tmp_path) == {"encode": g.neffs}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["encode"]


def test_compile_does_not_replace_a_folder_it_did_not_write(tmp_path, monkeypatch):
    _fake_compile(monkeypatch, lambda: b"FF")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not written by compile_graph"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "notes", root=tmp_path)
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep"


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
    ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=root)
    root.chmod(mode)
    with pytest.raises(PermissionError, match="not writable by others"):
        ncompile.collect_neffs(root)
    with pytest.raises(PermissionError, match="not writable by others"):
        ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=root)
    root.chmod(0o700)
    assert list(ncompile.collect_neffs(root)) == ["encode"]


def test_graph_directories_of_another_user_are_not_collected(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a folder to another user")
    _fake_compile(monkeypatch, lambda: b"FF")
    ncompile.compile_graph(lambda x: x, [torch.zeros(1)], "encode", root=tmp_path)
    other = tmp_path / "decode"
    other.mkdir()
    (other / ncompile.MARKER).write_text("decode\n")
    (other / "graph.neff").write_bytes(b"NEFF-theirs")
    os.chown(other, 65534, 65534)
    assert list(ncompile.collect_neffs(tmp_path)) == ["encode"]
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
])
def test_bad_visible_cores_are_refused(monkeypatch, spec, match):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", spec)
    with pytest.raises(ValueError, match=match):
        NeuronBackend().replica_cores(5)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", " 0-3 , 5 ")
    assert NeuronBackend().replica_cores(5) == [0, 1, 2, 3, 5]
