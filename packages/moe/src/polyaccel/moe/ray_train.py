"""Run :func:`polyaccel.moe.train.finetune` on N Ray Train workers.

``polyaccel-moe finetune CONFIG --ray --workers N`` calls :func:`run_with_ray`: every worker
runs the same training function as torchrun ranks do, in a process group Ray Train sets up
(NCCL when the cluster has GPUs, gloo otherwise), one GPU per worker. Submitted as a job
(``ray job submit -- polyaccel-moe finetune CONFIG --ray --workers N``) it attaches to that
cluster through ``RAY_ADDRESS``; run directly it starts a local one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from polyaccel.core.clitools import dumps
from polyaccel.moe.train_config import ConfigError, FinetuneConfig, from_dict

SUMMARY_FILE = "summary.json"


def _import_ray():
    try:
        import ray
        import ray.train
        import ray.train.torch
    except ImportError as e:
        raise ImportError("--ray needs Ray Train: pip install 'polyaccel-moe[ray]' "
                          "(ray[default,train])") from e
    return ray


def _train_worker(loop_config: dict[str, Any]) -> None:
    """The per-worker function: rebuild the config, train, report the summary."""
    import ray.train
    import ray.train.torch
    import torch

    from polyaccel.moe.train import finetune

    cfg = from_dict(FinetuneConfig, loop_config["config"])
    device = ray.train.torch.get_device() if loop_config["use_gpu"] else torch.device("cpu")
    result = finetune(cfg, device=device)
    summary = {**result.summary(), "losses": result.losses}
    # Ray Train keeps what a report carries in a checkpoint; rank 0's summary travels that way.
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            Path(tmp, SUMMARY_FILE).write_text(dumps(summary))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"final_loss": summary["final_loss"]}, checkpoint=checkpoint)


def _loopback_interface() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def keep_rendezvous_on_loopback() -> None:
    """Run in each Ray Train worker before its process group is set up. On a cluster that
    listens on loopback only (the private one, or a ``ray start`` on 127.0.0.1):

    - rank 0's ``TCPStore`` (the rendezvous every rank reads and writes, no authentication)
      listens on ``MASTER_ADDR`` (127.0.0.1), not on every interface as torch binds it;
    - gloo and NCCL bootstrap sockets use the loopback interface (``GLOO_SOCKET_IFNAME``,
      ``NCCL_SOCKET_IFNAME``), not the interface the host name resolves to.

    On other clusters nothing changes (ranks on other nodes must reach rank 0)."""
    import importlib
    import ipaddress

    import ray

    rendezvous = importlib.import_module("torch.distributed.rendezvous")  # torch.distributed.rendezvous: a function

    if not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
        return
    lo = _loopback_interface()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ[var] = lo
    create = rendezvous._create_c10d_store
    if getattr(create, "loopback_only", False):
        return

    def create_on_loopback(hostname, port, rank, world_size, timeout, use_libuv=True):
        try:
            loopback = ipaddress.ip_address(hostname).is_loopback
        except ValueError:
            loopback = False
        if rank != 0 or not loopback or rendezvous._torchelastic_use_agent_store():
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
        listener = socket.create_server((hostname, port), family=family)  # the store owns the fd
        return rendezvous.TCPStore(host_name=hostname, port=port, world_size=world_size, is_master=True,
                                   timeout=timeout, multi_tenant=True, master_listen_fd=listener.detach(),
                                   use_libuv=use_libuv)

    create_on_loopback.loopback_only = True
    rendezvous._create_c10d_store = create_on_loopback


def loopback_torch_config(backend: str) -> Any:
    """Ray Train's ``TorchConfig(backend=...)``, whose workers run
    :func:`keep_rendezvous_on_loopback` before they join the process group."""
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    class LoopbackTorchBackend(_TorchBackend):
        def on_start(self, worker_group, backend_config):
            worker_group.execute(keep_rendezvous_on_loopback)
            super().on_start(worker_group, backend_config)

    class LoopbackTorchConfig(TorchConfig):
        @property
        def backend_cls(self):
            return LoopbackTorchBackend

    return LoopbackTorchConfig(backend=backend)


def interruptible_trainer(**kwargs: Any) -> Any:
    """A ``TorchTrainer(**kwargs)`` whose ``fit()`` raises ``KeyboardInterrupt`` after a Ctrl-C.

    Ray Train's own SIGINT handler aborts the run, then ``fit()`` raises ``SystemExit(1)`` (a
    third Ctrl-C: ``SystemExit(0)``), so a Ctrl-C ended ``finetune --ray`` with status 1 or 0
    and no line saying where a rerun resumes. Here its handler still aborts the run, and the
    Ctrl-C is remembered (``trainer.interrupted``) so that :func:`run_with_ray` raises
    ``KeyboardInterrupt`` instead of that exit."""
    from ray.train.torch import TorchTrainer

    class InterruptibleTrainer(TorchTrainer):
        interrupted = False

        def _register_sigint_handler(self, controller):  # noqa: ANN001, ANN202 - Ray Train's hook
            super()._register_sigint_handler(controller)
            rays = signal.getsignal(signal.SIGINT)

            def on_sigint(signum, frame):  # noqa: ANN001, ANN202
                self.interrupted = True
                rays(signum, frame)

            signal.signal(signal.SIGINT, on_sigint)

    return InterruptibleTrainer(**kwargs)


def read_summary(path: Path, cfg: FinetuneConfig) -> dict[str, Any]:
    """Rank 0's summary as Ray Train handed it back in ``path``. One that cannot be read (missing,
    not UTF-8, not JSON, nested deeper than json parses, not an object) is a :class:`ConfigError`
    naming the file and where the run keeps what it trained (the run itself finished)."""
    try:
        summary = json.loads(path.read_bytes())
        why = None if isinstance(summary, dict) else f"a JSON {type(summary).__name__}, not an object"
    except OSError as e:
        why = e.strerror or str(e)
    except RecursionError:
        why = "not valid JSON (nested too deeply)"
    except ValueError as e:  # not JSON, or not UTF-8
        why = f"not valid JSON ({e})"
    if why is None:
        return summary
    kept = " and ".join(f"{key} {value}" for key, value in (("output_dir", cfg.output_dir),
                                                             ("checkpoint.dir", cfg.checkpoint.dir)) if value)
    raise ConfigError(f"the Ray Train run finished, but its summary {path} cannot be read: {why}"
                      + (f"; what it trained is in {kept}" if kept else ""))


def check_on_driver(cfg: FinetuneConfig, *, workers: int, use_gpu: bool | None, devices_only: bool = False) -> None:
    """The checks the training function runs before it trains (:func:`polyaccel.moe.train.check_run`),
    here, before any worker starts: a bad config then fails once with :class:`ConfigError`
    (exit 2), instead of in every worker, retried ``max_failures`` times. ``use_gpu`` None:
    the cluster's devices are not known yet; call again with ``devices_only`` once they are."""
    import torch

    from polyaccel.moe.train import check_run

    if devices_only:
        if cfg.train.cuda_graph is True and not use_gpu:
            raise ConfigError("train.cuda_graph=true: it needs a CUDA device, and the Ray cluster has no GPUs")
        return
    check_run(cfg, world_size=workers, device=None if use_gpu is None else torch.device("cuda" if use_gpu else "cpu"))


def run_with_ray(cfg: FinetuneConfig, *, workers: int, address: str | None = None,
                 use_gpu: bool | None = None, storage_path: str | None = None,
                 max_failures: int = 3) -> dict[str, Any]:
    """Train ``cfg`` on ``workers`` Ray Train workers; return rank 0's summary metrics.

    The config is checked here first (:func:`check_on_driver`): a :class:`ConfigError` before
    Ray starts, nothing trained. A worker (or its node) that dies makes Ray Train restart the whole group, up to
    ``max_failures`` times; the restarted workers resume from the newest checkpoint in
    ``checkpoint.dir`` (``checkpoint.resume: auto``), so set ``checkpoint.every_steps`` to
    bound the lost work. Without ``checkpoint.dir`` a restart trains from step 0.

    :param address: Ray cluster address; None means ``RAY_ADDRESS``, else a new private local
        cluster (loopback, token auth; also ``"local"``), shut down when the run ends; an
        already initialised Ray is reused (and left running).
    :param use_gpu: one GPU per worker; None = whether the cluster has GPUs.
    :param storage_path: where Ray Train keeps run state. Default: on a private local cluster
        started here, a private temporary folder removed when the run ends (the run resumes
        from ``checkpoint.dir``, not from this state); on a cluster connected to, Ray's
        ``~/ray_results`` (on several nodes it must be shared storage).
    :param max_failures: group restarts allowed before the run fails (bounded: never -1); the
        same bound for the controller's own failures (a worker group that cannot be placed:
        Ray Train retried that forever by default).
    """
    ray = _import_ray()
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if max_failures < 0:
        raise ValueError(f"max_failures must be >= 0 (bounded), got {max_failures}")
    check_on_driver(cfg, workers=workers, use_gpu=use_gpu)
    started_here, scratch = False, None
    if not ray.is_initialized():
        from polyaccel.core.ray_local import connect, init_local, starts_private_cluster

        if starts_private_cluster(address):
            init_local()  # a private cluster: loopback only, token auth; stopped when the run ends
            started_here = True
        else:
            connect(address)
    if storage_path is None and started_here:  # nothing left behind in ~/ray_results
        storage_path = scratch = tempfile.mkdtemp(prefix="polyaccel-ray-train-")
    try:
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
            check_on_driver(cfg, workers=workers, use_gpu=use_gpu, devices_only=True)
        if started_here:  # a cluster of fixed size: Ray Train would wait for more forever
            unit = "GPU" if use_gpu else "CPU"
            have = ray.cluster_resources().get(unit, 0)
            if workers > have:
                raise ConfigError(f"--workers {workers}: the private local Ray cluster has {have:g} {unit}s and each "
                                  f"worker takes one; use --workers {int(have) or 1} or less, or --address a larger cluster")
        trainer = interruptible_trainer(
            train_loop_per_worker=_train_worker,
            train_loop_config={"config": cfg.to_dict(), "use_gpu": use_gpu},
            scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu),
            torch_config=loopback_torch_config("nccl" if use_gpu else "gloo"),
            run_config=RunConfig(name="polyaccel-moe-finetune", storage_path=storage_path,
                                 failure_config=FailureConfig(max_failures=max_failures,
                                                              controller_failure_limit=max_failures)),
        )
        main_thread = threading.current_thread() is threading.main_thread()
        sigint = signal.getsignal(signal.SIGINT) if main_thread else None
        try:
            result = trainer.fit()
        except SystemExit:
            if trainer.interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            if sigint is not None:  # Ray Train leaves its handler in place after fit()
                signal.signal(signal.SIGINT, sigint)
        if trainer.interrupted:
            raise KeyboardInterrupt
        if result.checkpoint is None:
            raise RuntimeError(f"the Ray Train run returned no summary (error: {result.error})")
        with result.checkpoint.as_directory() as d:
            return read_summary(Path(d, SUMMARY_FILE), cfg)
    finally:
        if started_here:
            ray.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
