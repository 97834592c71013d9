"""Training checkpoints: a Hugging Face model directory plus the state to resume exactly.

Layout of ``<dir>/step_00000100/``:

- ``config.json``, ``*.safetensors`` — ``save_pretrained`` output; loads in plain Transformers;
- ``trainer_state.pt`` — optimizer (full, keyed by parameter name), LR scheduler, data
  position, step, and the run config;
- ``rng_rank{r}.pt`` — each rank's RNG states (``optimizer_rank{r}.pt`` too with dense
  replicas);
- ``manifest.json`` — written last: the step and every other file's size and sha256.

A checkpoint is written to ``step_N.tmp``; once every file is written (and synced) the
manifest is written atomically (temporary file, then ``os.replace``) and the directory is
renamed to ``step_N`` (rename is atomic on one file system); what follows the rename (syncing
its parent directory, pruning old checkpoints) cannot fail the save: a failure there is a
warning naming the path. A Ctrl-C or SIGTERM mid-save removes its ``.tmp``; a crash leaves
one that resume ignores and the next save clears (of its own step, or any later one); an old
checkpoint is pruned trainer state first and manifest last, so a crash while it is removed
leaves a ``step_N`` whose manifest names missing files (skipped, pruned again next time); a ``step_N`` without a valid manifest, or whose files no longer match it,
is not resumed from (:func:`find_resume` falls back to the newest intact one). Everything is
loaded with ``torch.load(weights_only=True)``: tensors and plain containers only, never code.
With several ranks the directory must be on a shared file system.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from polyaccel.core.files import sha256_of
from polyaccel.moe.train_config import ConfigError

logger = logging.getLogger("polyaccel.moe")

TRAINER_STATE = "trainer_state.pt"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_\d+\.tmp$")  # a save in progress, or cut off
_STEP_NAME = re.compile(r"^step_(\d+)(?:\.tmp)?$")  # either of the two
_CHUNK = 8 << 20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from: damaged, incomplete, unsafe or for another model."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint write that failed on some rank, raised on every rank alike (the ranks agree
    on it at the save's synchronisation points, so all leave the save together and may go on
    with collectives). ``reason`` says why, naming the rank that failed first."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LayoutMismatch(ValueError):
    """A checkpoint's optimizer state was written under another parallel layout."""


def step_dir(root: str | Path, step: int) -> Path:
    """Where the checkpoint of ``step`` lives."""
    return Path(root) / f"step_{step:08d}"


def _step_dirs(root: str | Path | None) -> list[Path]:
    """Every ``step_N`` directory under ``root`` (complete or not), oldest first."""
    if root is None or not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def step_number(name: str) -> int | None:
    """The step of a checkpoint folder's name (``step_00000004``: 4), None for another name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: str | Path | None) -> list[Path]:
    """Checkpoints under ``root`` whose save finished (they have a manifest), oldest first.
    Their bytes are checked only by :func:`verify_checkpoint`."""
    return [p for p in _step_dirs(root) if _is_file(p / MANIFEST)]


def written_checkpoints(root: str | Path | None) -> list[Path]:
    """Checkpoints under ``root`` that hold a run's state: complete ones and those written before
    manifests existed (a trainer state, no manifest), oldest first; not ``.tmp`` leftovers."""
    return [p for p in _step_dirs(root) if _holds_state(p)]


def not_checkpoints(root: str | Path | None) -> list[Path]:
    """``step_N`` directories under ``root`` that hold files but no run's state (neither a
    manifest nor a trainer state): not ours to replace, oldest first."""
    return [p for p in _step_dirs(root) if not _holds_state(p) and any(p.iterdir())]


def not_folders(root: str | Path | None) -> list[tuple[int, Path]]:
    """``(step, path)`` of the entries under ``root`` named like a checkpoint or a save in
    progress (``step_N``, ``step_N.tmp``) that are not folders (a file, a FIFO, a link to no
    folder): a save of step N can neither replace nor use them."""
    if root is None or not Path(root).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(root).iterdir() if (m := _STEP_NAME.match(p.name)) and not p.is_dir()]
    return sorted(found)


def _holds_state(step_dir: Path) -> bool:
    try:
        return (step_dir / MANIFEST).is_file() or (step_dir / TRAINER_STATE).is_file()
    except OSError:  # a folder this user may not enter may be one: verify_checkpoint says why it is not usable
        return True


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where it cannot be told (a folder this user may not enter)."""
    try:
        return path.is_file()
    except OSError:
        return False


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint was written at: from its manifest, else its name."""
    path = Path(path)
    try:
        return int(json.loads((path / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        m = _STEP_DIR.match(path.name)
        return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------
# Manifest: sizes and sha256 of every file, written last
# --------------------------------------------------------------------------------------------

def _digest(path: Path, sync: bool = False) -> tuple[int, str]:
    """(size, sha256 hex) of ``path``; ``sync`` also flushes it to stable storage."""
    with path.open("rb") as f:
        digest = sha256_of(f, _CHUNK)
        if sync:
            os.fsync(f.fileno())
    return path.stat().st_size, digest


def _digests(paths: list[Path], sync: bool = False) -> list[tuple[int, str]]:
    """:func:`_digest` of several files, in parallel (hashlib releases the GIL)."""
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        return list(pool.map(lambda p: _digest(p, sync), paths))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str | Path, step: int) -> Path:
    """Sync every file in ``directory`` and record its size and sha256 in ``manifest.json``,
    written atomically; call it after the last file is written."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(directory)): {"size": size, "sha256": sha}
               for p, (size, sha) in zip(files, _digests(files, sync=True), strict=True)}
    tmp = directory / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        json.dump({"format": 1, "step": step, "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync_dir(directory)
    return directory / MANIFEST


def verify_checkpoint(path: str | Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted (naming the file), or None if every
    file the manifest lists is present with its recorded size and sha256."""
    try:
        return _verify(Path(path))
    except OSError as e:  # a file or folder this user may not read, an I/O error
        return f"{e.filename or path} cannot be read ({e.strerror or e})"


def _verify(path: Path) -> str | None:
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{manifest} is missing (the save did not finish, or it predates checksums)"
    try:
        files = json.loads(manifest.read_text())["files"]
        listed = {name: (int(e["size"]), str(e["sha256"])) for name, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        return f"{manifest} is unreadable ({type(e).__name__}: {e})"
    if TRAINER_STATE not in listed:
        return f"{manifest} does not list {TRAINER_STATE}"
    from polyaccel.moe.ep_checkpoint import _inside

    outside = sorted(name for name in listed if not _inside(name))
    if outside:  # it would have files outside the checkpoint read and hashed (any file on the machine)
        return f"{manifest} lists {outside[0]!r}, outside {path}; a checkpoint's files are in its own folder"
    for name, (size, _) in listed.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {size} (truncated or overwritten)"
    names = sorted(listed)
    for name, (_, sha) in zip(names, _digests([path / n for n in names]), strict=True):
        if sha != listed[name][1]:
            return f"{path / name} fails its sha256 check (its bytes changed after it was written)"
    return None


# --------------------------------------------------------------------------------------------
# Choosing the checkpoint to resume from
# --------------------------------------------------------------------------------------------

def find_resume(root: str | Path | None, resume: str) -> Path | None:
    """The checkpoint to resume from (collective: rank 0 decides, every rank gets its answer).

    ``resume``: ``none``; ``auto``: the newest intact checkpoint under ``root`` (a damaged
    newer one is skipped with a warning naming the file and why; None when there is no
    checkpoint; :class:`CheckpointError` when there are some and none is intact); or a path:
    that checkpoint, which must be intact (:class:`CheckpointError` otherwise).
    """
    if resume == "none":
        return None
    answer: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            answer[0] = ("ok", _choose(root, resume))
        except CheckpointError as e:
            answer[0] = ("error", str(e))
    if dist.is_initialized():
        dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else Path(value)


def _choose(root: str | Path | None, resume: str) -> str | None:
    if resume != "auto":
        try:
            return str(_explicit(Path(resume)))
        except OSError as e:  # a folder this user may not enter
            raise CheckpointError(f"checkpoint.resume: {e.filename or resume} cannot be read "
                                  f"({e.strerror or e})") from None
    candidates = written_checkpoints(root)  # a step_N of other files (or none) is no checkpoint: not resumed
    reasons = []
    for path in reversed(candidates):
        why = verify_checkpoint(path)
        if why is None:
            return str(path)
        logger.warning("polyaccel.moe: not resuming from checkpoint %s: %s; trying an older one", path.name, why)
        reasons.append(f"{path.name}: {why}")
    if candidates:
        raise CheckpointError(f"checkpoint.resume=auto: none of the {len(candidates)} checkpoints in {root} is intact "
                              f"({'; '.join(reasons)}). Set checkpoint.resume=none to start over, "
                              "or checkpoint.resume=<path> to name one")
    return None


def _explicit(path: Path) -> Path:
    """Checks of an explicitly named checkpoint: intact, or (no manifest) at least complete."""
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume: {path} does not exist")
    if _PARTIAL_DIR.match(path.name):  # its files may be cut or unsynced; the next save there clears it
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete checkpoint: its save did not finish (a "
                              "kill or failure while it was written); name a complete one, or use checkpoint.resume=auto")
    if not (path / MANIFEST).is_file():
        if (path / TRAINER_STATE).is_file():
            logger.warning("polyaccel.moe: checkpoint %s has no %s (written before checksums?): resuming from it "
                           "unverified", path, MANIFEST)
            return path
        raise CheckpointError(f"checkpoint.resume: {path} is not a complete checkpoint (no {MANIFEST})")
    why = verify_checkpoint(path)
    if why is not None:
        raise CheckpointError(f"checkpoint.resume: {path} is damaged: {why}")
    return path


# --------------------------------------------------------------------------------------------
# Saving and loading
# --------------------------------------------------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


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


def _settle(error: BaseException | None) -> None:
    """A barrier at which the ranks also agree whether a write failed (collective when
    distributed): one process re-raises ``error``; with several ranks, a failure on any rank
    raises :class:`CheckpointWriteError` on every rank (else one rank would leave the save
    while the others wait for it in a collective)."""
    if not dist.is_initialized():
        if error is not None:
            raise error
        return
    verdicts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, None if error is None else describe(error))
    failed = [(r, why) for r, why in enumerate(verdicts) if why is not None]
    if failed:
        rank, why = failed[0]
        raise CheckpointWriteError(f"rank {rank}: {why}") from error


def describe(e: BaseException) -> str:
    """One line saying why ``e`` happened: a failed checkpoint write's reason (naming its rank),
    an OS error's text and file, else type and message."""
    if isinstance(e, CheckpointWriteError):
        return e.reason
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}{' ...' if len(text) > 300 else ''}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_file(path: str | Path, *, mmap: bool = False) -> Any:
    """``torch.load`` of a checkpoint file with ``weights_only=True`` (tensors and plain
    containers; anything that would run code is refused), errors naming the file. ``mmap``:
    tensors are mapped from the file, not read (to look at its small entries only)."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: it holds objects other than tensors and plain containers, and "
                              f"loading those could run code ({_first_line(e)})") from None
    except Exception as e:  # torch raises RuntimeError, EOFError, ... for damaged files
        raise CheckpointError(f"{path} cannot be read, damaged or truncated "
                              f"({type(e).__name__}: {_first_line(e)})") from e


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, torch CPU, CUDA when present)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (its Python state may come back with lists)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str | Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict[str, Any], keep_last: int = 0, per_rank_optimizer: bool = False) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank calls it) and prune old ones.
    The weights are the whole model's, as a Hugging Face checkpoint, whatever the layout
    (:func:`polyaccel.moe.ep_checkpoint.full_state_dict`). The manifest goes last, then the
    rename; a failure up to the rename fails the save, one after it (syncing the directory,
    pruning) is only a warning; see the module docstring.

    :param extra: trainer state of tensors, numbers, strings and plain containers (scheduler,
        data position, config...): what ``weights_only`` loading accepts.
    :param per_rank_optimizer: each rank saves its own optimizer state
        (``optimizer_rank{r}.pt``; dense replicas, whose ranks' optimizers hold different
        experts); resuming then needs the same layout. Otherwise rank 0 saves the full state.
    :returns: the final checkpoint directory.
    """
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        return _save(root, final, tmp, step, model, optimizer, extra, keep_last, per_rank_optimizer)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (clitools.Terminated) mid-save: no half folder left
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save(root: str | Path, final: Path, tmp: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
          extra: dict[str, Any], keep_last: int, per_rank_optimizer: bool) -> Path:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from polyaccel.moe.ep_checkpoint import full_state_dict

    rank = _rank()
    error = None  # a failed write; the ranks agree on it at each _settle (no rank left waiting)
    if rank == 0:
        try:
            _clear(tmp)
            tmp.mkdir(parents=True)
        except Exception as e:
            error = e
    _settle(error)
    model_sd = full_state_dict(model)
    optim_sd = None
    if not per_rank_optimizer:
        optim_sd = get_optimizer_state_dict(model, optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    try:
        if per_rank_optimizer:
            torch.save(_to_cpu(optimizer.state_dict()), tmp / f"optimizer_rank{rank}.pt")
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            model.save_pretrained(tmp, state_dict=model_sd)
            torch.save({"step": step, "optimizer": optim_sd, **extra}, tmp / TRAINER_STATE)
    except Exception as e:
        error = e
    _settle(error)
    if rank == 0:
        try:
            write_manifest(tmp, step)
            _clear(final)
            tmp.rename(final)
        except Exception as e:
            error = e
        else:  # the checkpoint is in place: what fails from here on is a warning, not a failed save
            _sync_dir(final)
            _remove_older_partials(root, step)
            if keep_last > 0:
                _prune(root, final, keep_last)
    _settle(error)
    return final


def _clear(path: Path) -> None:
    """Remove what a save is about to put at ``path``: an earlier folder of that step, or a link
    (only the link goes, never what it points to; ``rmtree`` refused it, and the save failed)."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _sync_dir(final: Path) -> None:
    """Sync the directory the checkpoint ``final`` was renamed into; a failure is a warning."""
    try:
        _fsync_dir(final.parent)
    except Exception as e:
        logger.warning("polyaccel.moe: checkpoint %s is written, but its directory %s could not be synced (%s): "
                       "a power loss now could undo the rename", final, final.parent, describe(e))


def _remove_older_partials(root: str | Path, step: int) -> None:
    """Remove the ``step_N.tmp`` folders of steps before ``step`` that killed saves left; one
    that cannot be removed is a warning naming it."""
    for p in Path(root).iterdir():
        if _PARTIAL_DIR.match(p.name) and int(p.name[5:-4]) < step:
            try:
                shutil.rmtree(p)
            except OSError as e:
                logger.warning("polyaccel.moe: could not remove %s, left by an interrupted save (%s)", p, describe(e))


def _prune(root: str | Path, final: Path, keep_last: int) -> None:
    """Remove the complete checkpoints under ``root`` older than the newest ``keep_last`` of
    those up to ``final`` (the one just written, always kept); newer ones (a damaged one a
    resume skipped, say) are left alone. One that cannot be removed is a warning naming it."""
    try:
        step = lambda p: int(_STEP_DIR.match(p.name).group(1))  # noqa: E731  (every step_N directory matches)
        upto = [p for p in complete_checkpoints(root) if step(p) <= step(final)]
        old = upto[:-keep_last]
    except Exception as e:
        logger.warning("polyaccel.moe: old checkpoints in %s were not pruned (checkpoint.keep_last=%d): %s",
                       root, keep_last, describe(e))
        return
    for path in old:
        try:
            _remove_checkpoint(path)
        except Exception as e:
            logger.warning("polyaccel.moe: old checkpoint %s could not be removed (checkpoint.keep_last=%d: %s); "
                           "remove it yourself", path, keep_last, describe(e))


def _remove_checkpoint(path: Path) -> None:
    """Remove the complete checkpoint ``path``, its manifest last: a kill in the middle of the
    removal leaves a ``step_N`` that still has its manifest (resume skips it: files are missing;
    the next prune removes it), never one holding its trainer state without its manifest (that
    passed for a checkpoint written before manifests, and pruning, which counts checkpoints by
    their manifest, never removed it again). A ``step_N`` that is a link (a checkpoint kept
    elsewhere) loses only the link: what it points to is outside ``checkpoint.dir``."""
    if path.is_symlink():
        path.unlink()
        return
    for entry in sorted(path.iterdir(), key=lambda p: p.name == TRAINER_STATE, reverse=True):
        if entry.name == MANIFEST:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.rmtree(path)


def load_trainer_state(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                       per_rank_optimizer: bool = False) -> dict[str, Any]:
    """Restore optimizer and this rank's RNG from checkpoint ``path`` into an already built
    (and, if distributed, already sharded) ``model``; return the rest of the trainer state.

    The model's weights are loaded separately, by ``from_pretrained(path)``.
    ``per_rank_optimizer``: read ``optimizer_rank{r}.pt`` (written with a gathered
    ``model_state_dict``, see :func:`save_checkpoint`). Files are read with
    :func:`load_file`; a damaged or unsafe one raises :class:`CheckpointError` naming it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    path = Path(path)
    state = load_file(path / TRAINER_STATE)
    if not isinstance(state, dict) or "optimizer" not in state:
        raise CheckpointError(f"{path / TRAINER_STATE} is not a polyaccel trainer state")
    saved = state.pop("optimizer")
    if per_rank_optimizer:
        own = path / f"optimizer_rank{_rank()}.pt"
        if not own.is_file():
            raise LayoutMismatch(
                f"{own.name} is missing in {path}: this checkpoint was not written by {_world()} ranks with "
                "parallel.dense=replicate; resume with the layout that wrote it")
        _restore(own, "optimizer state", lambda: optimizer.load_state_dict(load_file(own)))
    elif saved is None:
        raise LayoutMismatch(f"{path} keeps its optimizer state per rank (written with parallel.dense=replicate); "
                             "resume with that layout and world size")
    else:
        _restore(path / TRAINER_STATE, "optimizer state", lambda: set_optimizer_state_dict(
            model, optimizer, saved, options=StateDictOptions(full_state_dict=True)))
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.is_file():
        _restore(rng, "RNG states", lambda: set_rng_state(load_file(rng)))
    return state


def _restore(file: Path, what: str, load: Any) -> None:
    """Call ``load`` (restoring ``what`` from ``file``); a state it cannot take (a file that
    passed its manifest but is not what polyaccel wrote) is a :class:`CheckpointError` naming
    the file, not a traceback. Running out of memory, or a distributed failure, is this run's
    problem, not the file's: raised as it is."""
    try:
        load()
    except (CheckpointError, MemoryError, torch.OutOfMemoryError, dist.DistError):
        raise
    except Exception as e:
        raise CheckpointError(f"{file}: its {what} cannot be restored into this run ({describe(e)}); resume "
                              "from another checkpoint, or use a new checkpoint.dir") from None


def weights_error(path: str | Path, error: BaseException, model_shapes: dict[str, tuple[int, ...]] | None) -> CheckpointError:
    """A clear :class:`CheckpointError` for a failed ``from_pretrained(path)``: the unreadable
    safetensors file, or the per-expert tensors it lacks, or the tensors whose shapes differ
    from ``model_shapes`` (the model being built), or else the original error with the
    directory named."""
    from polyaccel.moe.ep_checkpoint import checkpoint_shapes, missing_expert_tensors, unreadable_file

    path = Path(path)
    bad = unreadable_file(path)
    if bad is not None:
        return CheckpointError(bad)
    missing = missing_expert_tensors(path)
    if missing:
        return CheckpointError(f"{path} lacks {len(missing)} expert weight tensor{'s' * (len(missing) > 1)} "
                               f"({', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}): the checkpoint "
                               "is incomplete; copy or download it again")
    if model_shapes:
        ckpt = checkpoint_shapes(path)
        diff = [f"{k}: checkpoint {ckpt[k]}, model {shape}" for k, shape in sorted(model_shapes.items())
                if k in ckpt and tuple(ckpt[k]) != tuple(shape)]
        if diff:
            return CheckpointError(f"{path} holds weights of another model shape ({len(diff)} tensors differ: "
                                   f"{'; '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}). Train with the model "
                                   "config it was written with (its config.json), or start a new checkpoint.dir")
    return CheckpointError(f"cannot load the weights in {path}: {type(error).__name__}: {_first_line(error)}")
