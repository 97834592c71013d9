"""Transcription as a Ray Data job: file paths go through ``map_batches`` to a pool of actors,
one per device (a GPU, a Trainium chip's 8 NeuronCores, or some CPUs), each holding its own
:class:`~polyaccel.asr.transcriber.Transcriber` and replica pool. Results come back to the
driver in input order as JSONL records (the CLI writes them, resumably).

Works inside ``ray job submit`` (connects to the job's cluster), against ``--address``, or
with a private in-process cluster when neither is given (loopback only, token auth, shut down
at the end: :mod:`polyaccel.core.ray_local`). Ray is imported only here, when asked for.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from polyaccel.asr.manifest import InputItem

_log = logging.getLogger(__name__)

RAY_INSTALL_HINT = "pip install 'polyaccel-asr[ray]' (or: pip install 'ray[default,data]')"


@dataclasses.dataclass(slots=True)
class RayJobOptions:
    """How to run the job. ``backend="auto"`` picks the best backend the *cluster* has
    resources for (GPU -> cuda, neuron_cores -> neuron, else cpu), not the driver's."""

    model: str = "whisper-tiny.en"
    backend: str = "auto"
    replicas: int | None = None
    batch_size: int | None = None  # None: the backend's default_batch_size
    dtype: str | None = None
    overlap_s: float = 3.0
    address: str | None = None
    num_actors: int | None = None
    rows_per_call: int | None = None  # paths per map_batches call (default: 4 batches per replica)
    local_num_cpus: int | None = None  # CPUs of the in-process cluster (default: all)
    timestamps: bool = False  # Whisper timestamp tokens: each record gets "segments"


def import_ray() -> Any:
    """``import ray`` with a clear message when it is missing."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as e:
        raise ImportError(f"the --ray job needs Ray Data: {RAY_INSTALL_HINT} ({e})") from None
    return ray


class TranscribeActor:
    """A Ray Data actor: one :class:`Transcriber` (with its own replica pool) per actor.

    Called with a batch of rows ``{"idx", "path", "read_path", "ref"}``; returns
    ``{"idx", "record"}`` where ``record`` is the JSON line for each row.
    """

    def __init__(self, opts: RayJobOptions, backend: str):
        from polyaccel.asr.transcriber import Transcriber

        dtype = None
        if opts.dtype:
            import torch

            dtype = getattr(torch, opts.dtype)
        self.model = opts.model
        self.transcriber = Transcriber.from_pretrained(opts.model, backend=backend, replicas=opts.replicas,
                                                       batch_size=opts.batch_size, dtype=dtype,
                                                       overlap_s=opts.overlap_s, timestamps=opts.timestamps)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        from polyaccel.asr.wer import wer

        # Paths travel as bytes: a file name that is not valid UTF-8 cannot be an Arrow string.
        items = [InputItem(os.fsdecode(p), str(r) if r else None) for p, r in zip(batch["read_path"], batch["ref"])]
        records = []
        for shown, r in zip(batch["path"], self.transcriber.transcribe(items)):
            extra: dict[str, Any] = {"model": self.transcriber.model_name or self.model,
                                     **self.transcriber.made_with(),
                                     "rtfx": round(self.transcriber.last_metrics.rtfx, 2), "actor": os.getpid()}
            if r.ref is not None and r.ok:
                extra["wer"] = round(wer([r.ref], [r.text]), 4)
            r.path = os.fsdecode(shown)
            records.append(json.dumps(r.to_record(**extra)))  # ASCII: lone surrogates become \u escapes
        return {"idx": np.asarray(batch["idx"]), "record": np.asarray(records, dtype=object)}


def cluster_backend(ray: Any, requested: str) -> tuple[str, dict[str, Any]]:
    """The backend actors run and the Ray resources each actor asks for.

    The resource key comes from the backend's ``ray_resource`` field: ``"GPU"`` ->
    ``num_gpus=1``, ``"CPU"`` -> ``num_cpus=1``, anything else (``"neuron_cores"``) ->
    ``resources={key: n}`` with n = the backend's ``ray_units_per_actor`` (8 NeuronCores, one
    Trainium2 chip at LNC=1, when the backend does not say).
    """
    from polyaccel.core import backends

    known = backends()
    have = ray.cluster_resources()
    if requested == "auto":
        fits = [b for b in known.values() if b.ray_resource and have.get(b.ray_resource, 0) > 0]
        be = fits[0] if fits else known["cpu"]
    elif requested in known:
        be = known[requested]
    else:
        from polyaccel.core.plugins import unknown_backend_message

        raise KeyError(unknown_backend_message(requested, known))
    key = be.ray_resource or "CPU"
    units = getattr(be, "ray_units_per_actor", None) or (8 if key == "neuron_cores" else 1)
    if key == "GPU":
        return be.name, {"num_gpus": units}
    if key == "CPU":
        return be.name, {"num_cpus": units}
    return be.name, {"num_cpus": 1, "resources": {key: units}}


def _actor_room(ray: Any, resources: dict[str, Any]) -> int:
    """How many actors asking for ``resources`` the cluster can place now (at least 1)."""
    have = ray.cluster_resources()
    if "num_gpus" in resources:
        return max(1, int(have.get("GPU", 1) // resources["num_gpus"]))
    if "resources" in resources:
        (key, units), = resources["resources"].items()
        return max(1, int(have.get(key, units) // units))
    return max(1, int(have.get("CPU", 1) // resources.get("num_cpus", 1)))


def _on_cpus(resources: dict[str, Any]) -> bool:
    """CPU actors: by default one per 4 CPUs, leaving room for Ray Data's own tasks and torch's threads."""
    return "num_gpus" not in resources and "resources" not in resources


class RowsLost(RuntimeError):
    """A Ray job ended without returning every row (the rows it did return were yielded)."""


class ActorsFailed(RuntimeError):
    """The job's actors could not start (a model that does not load on the cluster); the message
    is the actor's own error, in one line."""


def _actor_init_error(error_msg: str) -> str:
    """The last line of an actor's creation traceback, without the exception's module path
    (``polyaccel.asr.weights.ModelNotInstalled: ...`` -> ``ModelNotInstalled: ...``)."""
    lines = [x for x in error_msg.strip().splitlines() if x.strip()]
    last = lines[-1].strip() if lines else "the actor died while it started"
    return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", last)


def exactly_once_indexed(batches: Iterable[dict[str, Any]], n: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row, record)`` for each of rows ``0..n-1`` once, in input order, from ``{"idx", "record"}``
    batches.

    When an actor or a node dies, Ray re-runs its blocks: a row may then come back twice or
    late. Repeats are dropped, early rows wait for the ones before them, and a row that never
    came is an error, so the output holds every input exactly once. Of two copies of a row that
    arrive before it is yielded, an ok record wins over one with an error. If rows are missing
    at the end (or the batches fail), every row received after the gap is still yielded, in
    row order, before :class:`RowsLost` (or the batches' error) is raised.
    """
    pending: dict[int, dict[str, Any]] = {}
    done = 0
    try:
        for batch in batches:
            for idx, rec in zip(batch["idx"], batch["record"]):
                if int(idx) >= done:
                    _keep_better(pending, int(idx), json.loads(rec))
            while done in pending:
                yield done, pending.pop(done)
                done += 1
    except Exception:
        yield from _drain(pending)
        raise
    if done != n:
        got = sorted(pending)
        yield from _drain(pending)
        missing = [i for i in range(done, n) if i not in got]
        raise RowsLost(f"the Ray job returned {n - len(missing)} of {n} rows; row {done} never came back"
                       f"{_missing_note(missing)} (the {len(got)} rows received after it were yielded)")


def records_of(batches: Iterable[dict[str, Any]], items: Sequence[InputItem]) -> Iterator[dict[str, Any]]:
    """The job's record of each of ``items`` once, in input order (:func:`exactly_once_indexed`),
    each under its input's own path string, taken by row number: never what an actor decoded
    (another file-name encoding there would change it) nor a place in the stream."""
    for idx, rec in exactly_once_indexed(batches, len(items)):
        rec["path"] = items[idx].path
        yield rec


def _keep_better(pending: dict[int, dict[str, Any]], idx: int, rec: dict[str, Any]) -> None:
    """Hold ``rec`` for row ``idx`` unless a copy is held already; an ok copy replaces an error."""
    held = pending.get(idx)
    if held is None or (held.get("error") and not rec.get("error")):
        pending[idx] = rec


def _drain(pending: dict[int, dict[str, Any]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The rows held back behind a missing one, in row order (emptying ``pending``)."""
    for idx in sorted(pending):
        yield idx, pending.pop(idx)


def _missing_note(missing: list[int]) -> str:
    if len(missing) <= 1:
        return ""
    shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
    return f"; missing rows: {shown}"


def _drop_progress_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Progress bars disabled")


def _quiet_progress_notice() -> None:
    """Drop Ray Data's warning that its progress bars are off (they are off because the CLI
    draws its own; the warning tells the user to turn them on)."""
    log = logging.getLogger("ray.data._internal.progress")
    if _drop_progress_notice not in log.filters:
        log.addFilter(_drop_progress_notice)


def transcribe_with_ray(items: Sequence[InputItem], opts: RayJobOptions) -> Iterator[dict[str, Any]]:
    """Run ``items`` through a Ray Data actor pool; yield one output record per item, in
    input order (the same records the in-process path writes)."""
    ray = import_ray()
    started_here = False
    if not ray.is_initialized():
        from polyaccel.core.ray_local import connect, init_local, starts_private_cluster

        if starts_private_cluster(opts.address):  # stopped when the job ends
            init_local(opts.local_num_cpus or os.cpu_count(), log_to_driver=False)
            started_here = True
        else:
            connect(opts.address, logging_level="WARNING")
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    try:
        backend, resources = cluster_backend(ray, opts.backend)
        room = _actor_room(ray, resources)
        actors = opts.num_actors or max(1, room // 4 if _on_cpus(resources) else room)
        if actors > room:
            _log.warning("--num-actors %d: the cluster has room for %d now; the job starts with those "
                         "and grows if the cluster does", actors, room)
        per_call = opts.rows_per_call or max(1, 4 * (opts.batch_size or 8) * (opts.replicas or 1))
        logging.getLogger("ray.data").setLevel(logging.WARNING)  # per-dataset INFO lines are noise here
        ctx.execution_options.preserve_order = True  # results in input order, on the driver
        ctx.enable_progress_bars = False  # the CLI draws its own
        _quiet_progress_notice()
        rows = [{"idx": i, "path": os.fsencode(it.path), "read_path": os.fsencode(os.path.abspath(it.path)),
                 "ref": it.ref or ""}
                for i, it in enumerate(items)]
        ds = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // per_call)))
        ds = ds.map_batches(TranscribeActor, fn_constructor_kwargs={"opts": opts, "backend": backend},
                            batch_size=per_call, batch_format="numpy",
                            compute=ray.data.ActorPoolStrategy(min_size=max(1, min(actors, room)),
                                                               max_size=actors), **resources)
        try:
            yield from records_of(ds.iter_batches(batch_size=None, batch_format="numpy"), items)
        except ray.exceptions.RayActorError as e:
            if not getattr(e, "actor_init_failed", False):
                raise
            raise ActorsFailed(f"the Ray actors could not start: {_actor_init_error(e.error_msg)}") from None
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
        if started_here:
            ray.shutdown()
