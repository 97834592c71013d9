"""Hugging Face checkpoints under expert parallelism: each rank reads only its own experts.

Loading. The model is built on the meta device with each ``Experts`` holding ``E / ep``
experts, materialised empty on this rank's device, then filled straight from the safetensors
files: every non-expert tensor whole, and of the experts only this rank's block —

- per-expert keys (what ``save_pretrained`` writes, e.g.
  ``model.layers.3.mlp.experts.17.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.17.w1``):
  only the keys of local experts are read, each copied straight into its place in
  ``gate_up_proj [E_local, 2I, H]`` (gate rows, then up rows) or ``down_proj [E_local, H, I]``;
- fused keys (``mlp.experts.gate_up_proj [E, 2I, H]``): ``get_slice(key)[e0:e1]`` reads just
  the local rows.

So a rank reads the non-expert bytes plus ``1 / ep`` of the expert bytes. The model is then
sharded (experts over the MoE mesh, the rest FSDP2 over dp) by
:func:`polyaccel.moe.parallelize.apply_fsdp`.

Saving. :func:`save_pretrained` gathers the full state dict to rank 0 (DTensor experts and FSDP
shards alike) and writes it with the model's ``save_pretrained``, which restores Transformers'
per-expert keys: plain ``transformers``, vLLM and SGLang load the result.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import safetensors
import torch
import torch.distributed as dist
from torch import nn

from polyaccel.core.parallel import ParallelMeshes, ParallelPlan
from polyaccel.moe.layers import Experts, RotaryEmbedding

logger = logging.getLogger("polyaccel.moe")

#: per-expert checkpoint keys: (layer prefix, MoE module name, expert, projection)
_PER_EXPERT = re.compile(r"^(?P<prefix>.+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                         r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
#: fused checkpoint keys, Transformers v5's in-memory layout
_FUSED = re.compile(r"^(?P<prefix>.+)\.mlp\.experts\.(?P<name>gate_up_proj|down_proj)$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
#: checkpoint module names that our models call differently (Mixtral's MoE block)
_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def index_escape(path: str | Path) -> str | None:
    """Why a weight index (``*.index.json``) of checkpoint directory ``path`` is unsafe: a
    shard named by an absolute path or with ``..`` would be read from outside the folder (any
    file on the machine); None when every index names files inside it, or there is none."""
    path = Path(path)
    if not path.is_dir():
        return None
    for index in sorted(path.glob("*.index.json")):
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            names = set(weight_map.values())
        except (OSError, ValueError, AttributeError, TypeError, RecursionError) as e:
            return f"{index} cannot be read ({type(e).__name__}: {e})"
        for name in sorted(names, key=str):
            if not isinstance(name, str) or not _inside(name):
                return (f"{index} names the shard {name!r}, outside {path}; a checkpoint's shards must be files "
                        "in its own folder, so it is refused")
    return None


def _inside(name: str) -> bool:
    """Whether the relative file name ``name`` stays inside its folder (no absolute path, no ``..``)."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    return bool(parts) and parts[0] != "/" and ".." not in parts and not PureWindowsPath(name).drive


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of the checkpoint directory ``path`` (sharded or not); a
    ``ValueError`` when its index names files outside it (:func:`index_escape`)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        if (why := index_escape(path)) is not None:
            raise ValueError(why)
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json; polyaccel reads "
                            "local safetensors checkpoints only (pickled .bin/.pt weights can run code when "
                            "loaded, so they are never read)")


def unreadable_file(path: str | Path) -> str | None:
    """Why a safetensors file (or the index) of checkpoint ``path`` cannot be read, naming
    it; None when every file opens."""
    try:
        files = checkpoint_files(path)
    except FileNotFoundError as e:  # no safetensors at all: the message says so
        return str(e)
    except (OSError, ValueError, KeyError) as e:
        return f"{Path(path) / 'model.safetensors.index.json'} cannot be read ({type(e).__name__}: {e})"
    for file in files:
        try:
            with open(file, "rb"):  # safetensors says "No such file" of one this user may not read
                pass
        except OSError as e:
            return f"{file} cannot be read ({e.strerror or e})"
        try:
            with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as e:  # SafetensorError, OSError: damaged, truncated, missing
            return f"{file} cannot be read, damaged or truncated ({type(e).__name__}: {e})"
    return None


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes in checkpoint ``path`` (read from the headers only) under the model's
    names: per-expert keys folded into the fused ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]`` shapes."""
    shapes: dict[str, tuple[int, ...]] = {}
    per_expert: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
    count: dict[str, int] = defaultdict(int)
    for file in checkpoint_files(path):
        with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                shape = tuple(f.get_slice(key).get_shape())
                if m := _PER_EXPERT.match(key):
                    block = _rename(m["prefix"]) + ".mlp.experts"
                    per_expert[block].setdefault(_PROJ[m["proj"]], shape)
                    count[block] = max(count[block], int(m["e"]) + 1)
                else:
                    shapes[_rename(key)] = shape
    for block, proj in per_expert.items():
        if "gate" in proj and "up" in proj:
            shapes[f"{block}.gate_up_proj"] = (count[block], proj["gate"][0] + proj["up"][0], proj["gate"][1])
        if "down" in proj:
            shapes[f"{block}.down_proj"] = (count[block], *proj["down"])
    return shapes


def missing_expert_tensors(path: str | Path) -> list[str]:
    """Per-expert weights (the checkpoint's own names) that checkpoint ``path`` lacks: in each
    layer stored one tensor per expert, every projection found for one expert, for each of the
    experts its ``config.json`` counts (else up to the highest found). Headers only."""
    found: dict[str, set[tuple[int, str]]] = defaultdict(set)
    heads: dict[str, str] = {}
    for file in checkpoint_files(path):
        with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if m := _PER_EXPERT.match(key):
                    heads[m["prefix"]] = key[:m.start("e")]
                    found[m["prefix"]].add((int(m["e"]), m["proj"]))
    declared = _declared_experts(Path(path))
    missing = []
    for prefix, have in found.items():
        count = declared or max(e for e, _ in have) + 1
        projs = sorted({p for _, p in have})
        missing += [f"{heads[prefix]}{e}.{p}.weight" for e in range(count) for p in projs if (e, p) not in have]
    return missing


def _declared_experts(path: Path) -> int | None:
    """The routed experts per layer that checkpoint ``path``'s ``config.json`` declares."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = config.get(key) if isinstance(config, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def build_local_model(model_class: type, config: Any, ep: int, ep_rank: int, *, dtype: torch.dtype,
                      device: torch.device) -> nn.Module:
    """``model_class`` for ``config`` with uninitialised weights on ``device``, each ``Experts``
    holding only rank ``ep_rank``'s ``E / ep`` experts (``expert_offset`` records the first)."""
    with torch.device("meta"):
        model = model_class._from_config(config, dtype=dtype)
    for m in model.modules():
        if isinstance(m, Experts):
            if m.num_experts % ep:
                raise ValueError(f"the model has {m.num_experts} experts per layer, which ep={ep} does not divide")
            E_local = m.num_experts // ep
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(m, name)
                setattr(m, name, nn.Parameter(torch.empty((E_local, *p.shape[1:]), dtype=p.dtype, device="meta")))
            m.expert_offset = ep_rank * E_local
    model.to_empty(device=device)
    for m in model.modules():  # non-persistent buffers are not in checkpoints
        if isinstance(m, RotaryEmbedding):
            with torch.no_grad():
                m.inv_freq.copy_(m.compute_inv_freq()[0])
    return model


def load_local_weights(model: nn.Module, path: str | Path, unexpected: list[str] | None = None) -> dict[str, int]:
    """Fill ``model`` (from :func:`build_local_model`) from the checkpoint at ``path``, reading
    only this rank's experts. Ties ``lm_head`` to the embedding when the config says so.
    Checkpoint keys the model has no parameter for are ignored (a warning each), and appended
    to ``unexpected`` when given.

    :returns: bytes read, ``{"expert": ..., "other": ...}``.
    """
    own = dict(model.state_dict(keep_vars=True))
    experts = {name.removesuffix(".experts"): m for name, m in model.named_modules() if isinstance(m, Experts)}
    for block in experts.values():  # a whole model (not from build_local_model) holds every expert
        if not hasattr(block, "expert_offset"):
            block.expert_offset = 0
    tied = _tied_keys(model)
    loaded: set[str] = set()
    seen: dict[tuple[str, str], set[int]] = defaultdict(set)  # (MoE block, projection) -> local experts read
    read = {"expert": 0, "other": 0}
    bad = unreadable_file(path)
    if bad is not None:
        raise ValueError(bad)
    for file in checkpoint_files(path):
        with safetensors.safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if m := _PER_EXPERT.match(key):
                    block = experts.get(_rename(m["prefix"]) + ".mlp")
                    if block is None:
                        raise KeyError(f"checkpoint key {key} has no Experts module in {type(model).__name__}")
                    e = int(m["e"]) - block.expert_offset
                    if 0 <= e < block.gate_up_proj.shape[0]:  # only this rank's experts are read
                        t = f.get_tensor(key)
                        read["expert"] += _nbytes(t)
                        _copy_expert(block, _PROJ[m["proj"]], e, t, key)
                        seen[(_rename(m["prefix"]) + ".mlp", _PROJ[m["proj"]])].add(e)
                elif m := _FUSED.match(key):
                    name = _rename(m["prefix"]) + ".mlp.experts." + m["name"]
                    block = experts[_rename(m["prefix"]) + ".mlp"]
                    E_local = block.gate_up_proj.shape[0]
                    t = f.get_slice(key)[block.expert_offset:block.expert_offset + E_local]
                    read["expert"] += _nbytes(t)
                    _copy(own, name, t, loaded)
                else:
                    name = _rename(key)
                    if name not in own:
                        if name not in tied:
                            logger.warning("polyaccel.moe: ignoring checkpoint key %s (no such parameter)", key)
                            if unexpected is not None:
                                unexpected.append(key)
                        continue
                    t = f.get_tensor(key)
                    read["other"] += _nbytes(t)
                    _copy(own, name, t, loaded)
    for prefix, block in experts.items():
        parts = {proj: seen.get((prefix, proj), set()) for proj in ("gate", "up", "down")}
        if not any(parts.values()):
            continue  # fused keys, or absent (reported below)
        E_local = block.gate_up_proj.shape[0]
        for proj, found in parts.items():
            missing = [block.expert_offset + e for e in range(E_local) if e not in found]
            if missing:
                raise KeyError(f"checkpoint {path} lacks the {proj} weights of experts {missing} of {prefix}")
        loaded.update((f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"))
    _tie(model, tied)
    missing = sorted(k for k in own if k not in loaded and k not in tied)
    if missing:
        raise KeyError(f"checkpoint {path} lacks {len(missing)} weights of {type(model).__name__}: "
                       f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    return read


def _rename(key: str) -> str:
    for old, new in _RENAMES:
        key = key.replace(old, new)
    return key


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy(own: dict[str, torch.Tensor], name: str, t: torch.Tensor, loaded: set[str]) -> None:
    target = own[name]
    if tuple(target.shape) != tuple(t.shape):
        raise ValueError(f"checkpoint tensor for {name} has shape {tuple(t.shape)}, the model expects "
                         f"{tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(t)
    loaded.add(name)


def _copy_expert(block: Experts, proj: str, e: int, t: torch.Tensor, key: str) -> None:
    """Write one expert's checkpoint matrix into the fused local parameters: gate -> rows
    ``[:I]`` and up -> rows ``[I:]`` of ``gate_up_proj[e]``, down -> ``down_proj[e]``."""
    if proj == "down":
        target = block.down_proj[e]
    else:
        I = block.gate_up_proj.shape[1] // 2  # noqa: E741
        target = block.gate_up_proj[e, :I] if proj == "gate" else block.gate_up_proj[e, I:]
    if tuple(target.shape) != tuple(t.shape):
        raise ValueError(f"checkpoint tensor {key} has shape {tuple(t.shape)}, the model expects {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(t)


def _tied_keys(model: nn.Module) -> dict[str, str]:
    """``{tied key: source key}`` when the config ties input and output embeddings."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    return dict(getattr(model, "_tied_weights_keys", None) or {})


def _tie(model: nn.Module, tied: dict[str, str]) -> None:
    for target, source in tied.items():
        owner_name, _, attr = target.rpartition(".")
        owner = model.get_submodule(owner_name)
        setattr(owner, attr, model.get_parameter(source))


def load_expert_parallel(model_class: type, path: str | Path, config: Any, plan: ParallelPlan,
                         meshes: ParallelMeshes, *, dtype: torch.dtype, device: torch.device,
                         backend: Any = None, reshard_after_forward: bool = True,
                         unexpected: list[str] | None = None) -> nn.Module:
    """Build ``model_class`` from the checkpoint at ``path`` under ``plan`` (``ep > 1``):
    read this rank's experts only, select ``backend`` (a ``BackendConfig``), then shard the
    experts over the MoE mesh and the rest with FSDP2 over dp. Collective: every rank calls it.
    Checkpoint keys the model has no parameter for go to ``unexpected`` when given."""
    from polyaccel.moe.parallelize import apply_fsdp

    ep_mesh = meshes.moe["ep"]
    model = build_local_model(model_class, config, ep_mesh.size(), ep_mesh.get_local_rank(), dtype=dtype,
                              device=device)
    read = load_local_weights(model, path, unexpected)
    logger.info("polyaccel.moe: rank %d read %.1f MB of experts and %.1f MB of other weights", dist.get_rank(),
                read["expert"] / 1e6, read["other"] / 1e6)
    model.eval()  # as Transformers' from_pretrained returns it
    if backend is not None:
        model.apply_backend(backend)
    apply_fsdp(model, plan, meshes, param_dtype=dtype, reduce_dtype=torch.float32,
               reshard_after_forward=reshard_after_forward)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU of rank 0, whatever the layout (a collective:
    every rank calls it; other ranks may get an empty or partial dict): FSDP2 shards and
    DTensor experts through ``get_model_state_dict``; plain expert blocks (dense replicas,
    :mod:`polyaccel.moe.dense_replicas`) all-gathered over their dispatcher's EP group into
    the whole ``[E, ...]`` tensors. Without a process group: the model's own state dict."""
    if not dist.is_initialized():
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for prefix, experts in model.named_modules():
        if not isinstance(experts, Experts) or experts.dispatcher is None:
            continue
        group = experts.dispatcher.group
        ep = dist.get_world_size(group)
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            if hasattr(p, "to_local") or p.shape[0] == experts.num_experts:
                continue  # a DTensor (gathered above) or already whole
            whole = p.new_empty((ep * p.shape[0], *p.shape[1:]))
            dist.all_gather_into_tensor(whole, p.detach().contiguous(), group=group)
            if dist.get_rank() == 0:
                state[f"{prefix}.{name}" if prefix else name] = whole.cpu()
    return state


def save_pretrained(model: nn.Module, save_directory: str | Path, **kwargs: Any) -> None:
    """``save_pretrained`` for a model sharded by FSDP2 and/or expert parallelism: gathers the
    full state dict to rank 0 (:func:`full_state_dict`, a collective: every rank calls it),
    which writes a standard Hugging Face checkpoint with per-expert keys. Without a process
    group it is the model's own ``save_pretrained``."""
    if not dist.is_initialized():
        model.save_pretrained(save_directory, **kwargs)
        return
    state = full_state_dict(model)
    if dist.get_rank() == 0:
        model.save_pretrained(save_directory, state_dict=state, **kwargs)
    dist.barrier()


__all__ = ["build_local_model", "checkpoint_files", "checkpoint_shapes", "full_state_dict", "index_escape",
           "load_expert_parallel", "load_local_weights", "save_pretrained", "unreadable_file"]
