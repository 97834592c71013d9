"""Training checkpoints: a Hugging Face model directory plus the state to resume exactly.

Layout of ``<dir>/step_00000100/``:

- ``config.json``, ``*.safetensors`` — ``save_pretrained`` output; loads in plain Transformers;
- ``trainer_state.pt`` — optimizer (full, keyed by parameter name), LR scheduler, data
  position, step, and the run config;
- ``rng_rank{r}.pt`` — each rank's RNG states.

A checkpoint is written to ``step_N.tmp`` and renamed to ``step_N`` once complete (rename is
atomic on one file system), so a crash mid-save leaves only a ``.tmp`` that resume ignores
and the next save clears. With several ranks the directory must be on a shared file system.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TRAINER_STATE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives."""
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | Path | None) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if root is None or not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / TRAINER_STATE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class LayoutMismatch(ValueError):
    """A checkpoint's optimizer state was written under another parallel layout."""


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, torch CPU, CUDA when present)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], keep_last: int = 0, per_rank_optimizer: bool = False) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it) and prune old ones.
    The weights are the whole model's, as a Hugging Face checkpoint, whatever the layout
    (:func:`polyaccel.moe.ep_checkpoint.full_state_dict`).

    :param extra: JSON/pickle-able trainer state (scheduler, data position, config...).
    :param per_rank_optimizer: each rank saves its own optimizer state
        (``optimizer_rank{r}.pt``; dense replicas, whose ranks' optimizers hold different
        experts); resuming then needs the same layout. Otherwise rank 0 saves the full state.
    :returns: the final checkpoint directory.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from polyaccel.moe.ep_checkpoint import full_state_dict

    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd = full_state_dict(model)
    optim_sd = None
    if per_rank_optimizer:
        torch.save(_to_cpu(optimizer.state_dict()), tmp / f"optimizer_rank{rank}.pt")
    else:
        optim_sd = get_optimizer_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        model.save_pretrained(tmp, state_dict=model_sd)
        torch.save({"step": step, "optimizer": optim_sd, **extra}, tmp / TRAINER_STATE)
        shutil.rmtree(final, ignore_errors=True)
    _barrier()
    if rank == 0:
        tmp.rename(final)
        if keep_last > 0:
            for old in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_trainer_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                       per_rank_optimizer: bool = False) -> dict[str, Any]:
    """Restore optimizer and this rank's RNG from checkpoint ``path`` into an already built
    (and, if distributed, already sharded) ``model``; return the rest of the trainer state.

    The model's weights are loaded separately, by ``from_pretrained(path)``.
    ``per_rank_optimizer``: read ``optimizer_rank{r}.pt`` (written with a gathered
    ``model_state_dict``, see :func:`save_checkpoint`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path = Path(path)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    saved = state.pop("optimizer")
    if per_rank_optimizer:
        own = path / f"optimizer_rank{_rank()}.pt"
        if not own.is_file():
            raise LayoutMismatch(
                f"{own.name} is missing in {path}: this checkpoint was not written by {_world()} ranks with "
                "parallel.dense=replicate; resume with the layout that wrote it")
        optimizer.load_state_dict(torch.load(own, map_location="cpu", weights_only=False))
    elif saved is None:
        raise LayoutMismatch(f"{path} keeps its optimizer state per rank (written with parallel.dense=replicate); "
                             "resume with that layout and world size")
    else:
        set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        set_rng_state(torch.load(rng, weights_only=False))
    return state
