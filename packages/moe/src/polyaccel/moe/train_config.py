"""Configuration of ``polyaccel-moe finetune``: nested dataclasses, presets, YAML loading.

A run is described by one :class:`FinetuneConfig` built from three layers; **later layers
win**:

1. **preset defaults** — when ``model.preset`` names a preset (from the file or from
   ``--set model.preset=...``), that preset function's :class:`FinetuneConfig` is the
   starting point (model shape, batch shape, synthetic data...); otherwise the dataclass
   defaults are;
2. **the YAML file** — its keys are merged into the preset, key by key (nested mappings
   merge, everything else replaces);
3. **command-line overrides** — ``--set a.b=c`` (``c`` is parsed as YAML) replace single keys
   last.

Unknown keys are errors with a did-you-mean; values are checked against the field types;
errors in a file name its line (``file.yaml:12: ...``). Relative *input* paths in the file
(``model.path``, ``data.jsonl``/``text``/``tokenizer``) are resolved against the file's
directory; relative *output* paths (``checkpoint.dir``/``resume``, ``output_dir``,
``log.metrics_jsonl``) against the working directory, so running a packaged example never
writes next to it.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from polyaccel.core.files import real_path


class ConfigError(ValueError):
    """A configuration that cannot run: unknown key, wrong type, missing file, bad shape.
    ``key``: the dotted config key at fault, when known."""

    def __init__(self, message: str, *, key: str | None = None):
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------------------------
# The config tree
# --------------------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to train.

    Attributes:
        path: a local Hugging Face checkpoint directory (``config.json`` + safetensors).
        preset: a preset name (``polyaccel-moe presets``); supplies ``config`` and run defaults.
        config: Hugging Face config fields. Without ``path`` it must hold ``model_type`` and
            the model is randomly initialised from it; with ``path`` its keys override the
            checkpoint's config (e.g. ``num_hidden_layers``).
        backend: fields of ``polyaccel.moe.BackendConfig`` (attention, experts, dispatcher,
            gate...); only for ``implementation: polyaccel``.
        implementation: ``polyaccel`` (our model classes, the default) or ``transformers``
            (plain ``transformers.AutoModelForCausalLM``, the baseline).
        attn_implementation: passed to Transformers (``sdpa``, ``eager``...); None = its default.
    """

    path: str | None = None
    preset: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    backend: dict[str, Any] = field(default_factory=dict)
    implementation: Literal["polyaccel", "transformers"] = "polyaccel"
    attn_implementation: str | None = None


@dataclass(kw_only=True, slots=True)
class SyntheticConfig:
    """Random tokens, uniform over ``[0, vocab)``, one fresh sequence per sample (benchmarks).

    The sequence length is ``train.seq_len``. ``vocab`` defaults to the model's vocab size.
    """

    vocab: int | None = None


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training data: exactly one of ``jsonl``, ``text`` or ``synthetic``.

    Attributes:
        jsonl: JSON-lines file; each record has ``field`` (default ``text``), or ``prompt`` and
            ``completion`` (loss on the completion only), or pre-tokenized ``input_ids``.
        text: plain text file; documents are separated by blank lines.
        field: the text field of ``jsonl`` records.
        tokenizer: tokenizer directory; defaults to ``model.path`` (loaded offline).
        synthetic: random tokens (``synthetic: {}`` or ``synthetic: true``).
        shuffle: shuffle packed samples each epoch (seeded by ``train.seed``).
        cache: tokenize a ``jsonl``/``text`` file once into a token cache in
            ``checkpoint.dir/.data_cache`` and train from its memory map
            (:mod:`polyaccel.moe.data_cache`); ``false`` (or no ``checkpoint.dir``): every
            process tokenizes the file in memory at every start.
    """

    jsonl: str | None = None
    text: str | None = None
    field: str = "text"
    tokenizer: str | None = None
    synthetic: SyntheticConfig | None = None
    shuffle: bool = True
    cache: bool = True


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The optimisation: batch shape, AdamW, schedule, precision.

    Global batch per optimizer step = ``micro_batch x grad_accum x dp`` sequences of
    ``seq_len`` tokens. ``dtype`` is the compute dtype; parameters and optimizer state are
    stored in it too unless ``fp32_master`` keeps an fp32 copy (parameters in fp32,
    computation autocast/cast to bf16).

    ``optimizer``: ``flat_adamw`` (:class:`polyaccel.moe.optim.FlatAdamW`, AdamW over one flat
    buffer per param group: one kernel per step), ``adamw`` (``torch.optim.AdamW``, fused on
    CUDA), or ``auto``: ``flat_adamw`` in a single process or with ``parallel.dense:
    replicate``, ``adamw`` under FSDP2 (sharded DTensor parameters, which FlatAdamW cannot
    flatten).

    ``cuda_graph``: replay each micro-batch's forward + backward as one CUDA graph
    (:class:`polyaccel.moe.graphed_step.GraphedMicroStep`). ``auto`` (the default) turns it on
    where it applies (CUDA, FlatAdamW, no activation checkpointing, one process or
    ``parallel.dense: replicate`` with a dispatcher that never waits on the host) and logs once
    why not elsewhere; ``true`` makes an unmet requirement an error. Micro-batches of another
    shape (a short last batch) run eagerly.

    ``wgrad_window``: compute the expert weight gradients once per this many micro-batches, in
    one kernel over all their token rows (:func:`polyaccel.moe.grouped_linear.wgrad_window`;
    CUDA, no FSDP2, ``backend.grad_accumulation: fused``): fewer passes over ``.grad``, for the
    memory of ``wgrad_window - 1`` micro-batches' expert activations. ``auto`` (the default)
    takes the largest window up to ``grad_accum`` whose kept activations fit in
    :data:`polyaccel.moe.fast_path.WINDOW_MEMORY_SHARE` of the device's memory (1 where it does
    not apply).

    ``nonfinite``: a step whose loss or gradient norm is NaN or infinite either ``stop``s the
    run (an error naming the step; nothing of that step is saved) or, with ``skip``, has its
    optimizer step skipped (counted in the result and logged).
    """

    seq_len: int = 2048
    micro_batch: int = 1
    grad_accum: int = 1
    max_steps: int = 100
    lr: float = 1e-5
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    optimizer: Literal["auto", "adamw", "flat_adamw"] = "auto"
    grad_clip: float | None = 1.0
    seed: int = 0
    activation_checkpointing: bool = False
    cuda_graph: bool | Literal["auto"] = "auto"
    wgrad_window: int | Literal["auto"] = "auto"
    dtype: Literal["bf16", "fp32"] = "bf16"
    fp32_master: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    nonfinite: Literal["stop", "skip"] = "stop"


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Periodic checkpoints and resume.

    Attributes:
        dir: where ``step_00000100/`` directories go; None disables checkpoints.
        every_steps: save every this many optimizer steps (0: only at the end of the run).
        keep_last: keep this many newest checkpoints (0 keeps all).
        resume: ``auto`` (latest complete checkpoint in ``dir`` if any), ``none``, or a path
            to one checkpoint directory.
    """

    dir: str | None = None
    every_steps: int = 0
    keep_last: int = 2
    resume: str = "auto"


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Process layout. ``dp`` None means all ranks; ``ep`` splits each layer's experts over
    that many ranks (it divides the world size and the expert count).

    ``dense``: how the non-expert weights are kept on several ranks. ``fsdp`` shards them with
    FSDP2 (least memory; HSDP with ``dp_replicate``); ``replicate`` keeps a whole copy on every
    rank and all-reduces their gradients once per step (:mod:`polyaccel.moe.dense_replicas`):
    more memory for those weights, but FlatAdamW, fused weight gradients and CUDA graphs work,
    which makes it the fast layout on a few GPUs.
    """

    dp: int | None = None
    dp_replicate: int = 1
    ep: int = 1
    dense: Literal["fsdp", "replicate"] = "fsdp"


@dataclass(kw_only=True, slots=True)
class LogConfig:
    """Logging: progress bar, a metrics line every ``every_steps`` steps, optional JSONL file."""

    every_steps: int = 1
    progress_bar: bool = True
    metrics_jsonl: str | None = None
    peak_tflops: float | None = None


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters instead of full fine-tuning (:mod:`polyaccel.moe.lora`; needs ``peft``).

    The base weights are frozen; PEFT's adapters are trained, checkpointed and written to
    ``output_dir`` (a PEFT adapter directory). ``target_modules``: linear modules by name
    (default q/k/v/o); ``experts`` / ``router``: adapters on the fused experts / router
    weight; ``dropout`` only without those two; ``recompute: selective`` checkpoints each
    layer keeping the GEMM and attention outputs, ``auto`` (the default) only where the memory
    estimate without it exceeds 85% of the GPU.
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Any = ("q_proj", "k_proj", "v_proj", "o_proj")
    experts: bool = True
    router: bool = False
    recompute: Literal["none", "selective", "auto"] = "auto"


@dataclass(kw_only=True, slots=True)
class FinetuneConfig:
    """A whole fine-tuning run; ``output_dir`` receives the final ``save_pretrained``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig | None = None
    output_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-able; tuples become lists)."""
        return _plain(dataclasses.asdict(self))


# --------------------------------------------------------------------------------------------
# Presets (functions, so each call returns a fresh config)
# --------------------------------------------------------------------------------------------

def qwen3_moe_tiny() -> FinetuneConfig:
    """A 2-layer Qwen3-MoE with 4 experts and 128 tokens of vocab: CPU smoke tests, seconds."""
    return FinetuneConfig(
        model=ModelConfig(preset="qwen3-moe-tiny", config=dict(
            model_type="qwen3_moe", vocab_size=128, hidden_size=32, intermediate_size=64,
            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, tie_word_embeddings=False)),
        data=DataConfig(synthetic=SyntheticConfig()),
        train=TrainConfig(seq_len=32, micro_batch=2, grad_accum=2, max_steps=4, lr=1e-3,
                          warmup_steps=1, dtype="fp32", device="cpu"),
    )


def qwen3_30b_a3b_l8() -> FinetuneConfig:
    """The reference MoE workload (docs/benchmarks.md): Qwen3-30B-A3B layer shapes with 8 layers (5.6B
    parameters), seq 4096, micro-batch 1, 4 micro-batches per step, bf16, synthetic tokens."""
    from polyaccel.moe.presets import qwen3_30b_a3b  # the model shape is defined once, there

    shape = qwen3_30b_a3b(num_hidden_layers=8).to_diff_dict()
    shape.pop("transformers_version", None)
    return FinetuneConfig(
        model=ModelConfig(preset="qwen3-30b-a3b-L8", config=shape),
        data=DataConfig(synthetic=SyntheticConfig()),
        train=TrainConfig(seq_len=4096, micro_batch=1, grad_accum=4, max_steps=20, lr=1e-5,
                          dtype="bf16", weight_decay=0.0),
        log=LogConfig(every_steps=1),
    )


def _benchmark_preset(name: str, shape: Any) -> FinetuneConfig:
    """A benchmark workload on ``shape`` (a Transformers config): random init, seq 4096,
    micro-batch 1, 4 micro-batches per step, bf16, synthetic tokens."""
    fields = shape.to_diff_dict()
    fields.pop("transformers_version", None)
    fields["model_type"] = shape.model_type
    return FinetuneConfig(
        model=ModelConfig(preset=name, config=fields),
        data=DataConfig(synthetic=SyntheticConfig()),
        train=TrainConfig(seq_len=4096, micro_batch=1, grad_accum=4, max_steps=20, lr=1e-5,
                          dtype="bf16", weight_decay=0.0),
        log=LogConfig(every_steps=1),
    )


def olmoe_1b_7b() -> FinetuneConfig:
    """OLMoE-1B-7B's shapes, all 16 layers (6.9B parameters), as the reference workload."""
    from polyaccel.moe.presets import olmoe_1b_7b as shape

    return _benchmark_preset("olmoe-1b-7b", shape())


def mixtral_8x7b_l4() -> FinetuneConfig:
    """Mixtral-8x7B's shapes with 4 layers (6.1B parameters), as the reference workload."""
    from polyaccel.moe.presets import mixtral_8x7b as shape

    return _benchmark_preset("mixtral-8x7b-L4", shape(num_hidden_layers=4))


def qwen3_235b_a22b_l2() -> FinetuneConfig:
    """Qwen3-235B-A22B's layer shapes with 2 layers (6.2B parameters): few tokens per expert
    at a wide hidden size, as a benchmark workload."""
    from polyaccel.moe.presets import qwen3_235b_a22b as shape

    return _benchmark_preset("qwen3-235b-a22b-L2", shape(num_hidden_layers=2))


def moonlight_16b_a3b_l8() -> FinetuneConfig:
    """Moonlight-16B-A3B's shapes (DeepSeek-V3 architecture) with 8 layers (4.8B parameters),
    as a benchmark workload."""
    from polyaccel.moe.presets import moonlight_16b_a3b as shape

    return _benchmark_preset("moonlight-16b-a3b-L8", shape(num_hidden_layers=8))


PRESETS: dict[str, Callable[[], FinetuneConfig]] = {
    "qwen3-moe-tiny": qwen3_moe_tiny,
    "qwen3-30b-a3b-L8": qwen3_30b_a3b_l8,
    "olmoe-1b-7b": olmoe_1b_7b,
    "mixtral-8x7b-L4": mixtral_8x7b_l4,
    "qwen3-235b-a22b-L2": qwen3_235b_a22b_l2,
    "moonlight-16b-a3b-L8": moonlight_16b_a3b_l8,
}


def preset(name: str) -> FinetuneConfig:
    """The preset called ``name`` as a fresh :class:`FinetuneConfig`."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                          f"known: {', '.join(PRESETS)}")
    return PRESETS[name]()


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                values: Mapping[str, Any] | None = None) -> FinetuneConfig:
    """Build a :class:`FinetuneConfig` from a YAML file (or the same tree as ``values``) and
    ``--set`` overrides.

    Precedence is stated in this module's docstring: overrides > file > preset defaults.
    """
    file_dict: dict[str, Any] = dict(values or {})
    base_dir = Path.cwd()
    text = ""
    if path is not None:
        path = Path(path)
        text = _read_yaml_text(path)
        try:
            loaded = load_yaml(text, str(path)) or {}
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(str(path), e)) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        file_dict = loaded
        base_dir = real_path(path).parent
    file_dict = _resolve_paths(_resolve_paths(file_dict, base_dir, _INPUT_PATHS), Path.cwd(), _OUTPUT_PATHS)
    cli_dict: dict[str, Any] = {}
    for item in overrides:
        _apply_override(cli_dict, item)
    cli_dict = _resolve_paths(cli_dict, Path.cwd())

    preset_name = (_get(cli_dict, "model.preset") or _get(file_dict, "model.preset"))
    if preset_name is not None and not isinstance(preset_name, str):
        raise _locate(ConfigError(f"model.preset: expected a preset name, got {preset_name!r}", key="model.preset"),
                      path, text, cli_dict)
    merged = preset(preset_name).to_dict() if preset_name else FinetuneConfig().to_dict()
    model_path = _get(cli_dict, "model.path", _get(file_dict, "model.path"))  # --set model.path=null unsets it
    if preset_name and model_path:
        merged["model"]["config"] = {}  # a checkpoint brings its own config; keep only explicit keys
    model_type = next((t for t in (_get(cli_dict, "model.config.model_type"), _get(file_dict, "model.config.model_type"),
                                   _get(merged, "model.config.model_type")) if isinstance(t, str)), None)
    merged = _canonical_names(merged, model_type)
    for layer in (file_dict, cli_dict):
        sources = [k for k in _DATA_SOURCES if isinstance(layer.get("data"), Mapping) and k in layer["data"]]
        if sources:  # a layer naming a data source replaces the one below it
            merged["data"].update({k: None for k in _DATA_SOURCES})
        merged = _merge(merged, _canonical_names(layer, model_type))
    try:
        return from_dict(FinetuneConfig, merged)
    except ConfigError as e:
        raise _locate(e, path, text, cli_dict) from None


def _read_yaml_text(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; give a YAML file "
                          "(e.g. packages/moe/examples/tiny_synthetic_cpu.yaml)")
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if not path.is_file():  # a FIFO or a device (/dev/zero) would be read without end
        raise ConfigError(f"config file {path} is not a regular file")
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read ({e})") from None


MAX_YAML_VALUES = 100_000
"""Values (mapping keys and values, list items, scalars) a config may hold once its YAML
aliases are expanded; real configs hold hundreds."""


def load_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing (:class:`ConfigError`) documents that alias
    themselves or whose aliases (``*name``) expand past :data:`MAX_YAML_VALUES` values: a few
    lines of nested aliases can stand for billions of values, which the config merge would
    copy out in full."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        count = _expanded_values(node, {}, where)
        if count > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: its YAML aliases expand to over {MAX_YAML_VALUES:,} values; "
                              "write the values out instead")
        return loader.construct_document(node)
    except ConfigError:
        raise
    except (ValueError, OverflowError) as e:  # a value YAML reads but Python cannot build: 2024-13-45, 10**5000
        raise ConfigError(f"{where}: {' '.join(str(e).split())[:300]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        loader.dispose()


def _expanded_values(node: yaml.Node, seen: dict[int, int | None], where: str) -> int:
    """Values under ``node`` with every alias expanded (each distinct node counted once and
    reused); ``seen`` maps a node in progress to None, so a node inside itself is refused, as
    is a mapping that sets one key twice."""
    key = id(node)
    if key in seen:
        count = seen[key]
        if count is None:
            raise ConfigError(f"{where}: a YAML alias refers to a value that contains it")
        return count
    seen[key] = None
    count = 1
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":  # YAML keeps the last silently
                if (k.tag, k.value) in first:
                    raise ConfigError(f"{where}: the key {k.value!r} appears twice in one mapping (lines "
                                      f"{first[k.tag, k.value]} and {k.start_mark.line + 1}); only the last would "
                                      "count, dropping the first silently. Merge them into one")
                first[k.tag, k.value] = k.start_mark.line + 1
            count += _expanded_values(k, seen, where) + _expanded_values(v, seen, where)
            if count > MAX_YAML_VALUES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            count += _expanded_values(v, seen, where)
            if count > MAX_YAML_VALUES:
                break
    seen[key] = count
    return count


def _yaml_error(where: str, e: yaml.YAMLError, position: bool = True) -> str:
    """``file:line:column: YAML syntax error: problem`` for a YAML parser error."""
    mark = getattr(e, "problem_mark", None)
    loc = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark is not None and position else where
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return f"{loc}: YAML syntax error: {problem}" + (f" ({context})" if context else "")


def _locate(e: ConfigError, path: Path | None, text: str, cli_dict: Mapping[str, Any]) -> ConfigError:
    """``e`` prefixed with ``file:line`` of its key, when the value came from the file."""
    if path is None or e.key is None or _has(cli_dict, e.key):
        return e
    line = _key_line(text, e.key)
    return e if line is None else ConfigError(f"{path}:{line}: {e}", key=e.key)


def _key_line(text: str, dotted: str) -> int | None:
    """1-based line of the deepest part of ``dotted`` found in the YAML ``text``."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in dotted.split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        match = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
        if match is None:
            break
        line, node = match[0].start_mark.line + 1, match[1]
    return line


def from_dict(cls: type, data: Mapping[str, Any], where: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, checking keys and value types recursively."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key {_join(where, key)!r}{did_you_mean(str(key), names)}; "
                              f"valid keys{' under ' + repr(where) if where else ''}: {', '.join(names)}",
                              key=_join(where, str(key)))
    kwargs = {}
    for k, v in data.items():
        try:
            kwargs[k] = _coerce(hints[k], v, _join(where, k))
        except ConfigError as e:
            e.key = e.key or _join(where, k)
            raise
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if (value is None or value is False) and type(None) in options:
            return None  # `synthetic: false` switches an optional section off
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _coerce(opt, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{where}: {value!r} is not a valid {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if dataclasses.is_dataclass(tp):
        if value is True or value == {} or value is None:
            return tp()
        return from_dict(tp, value, where)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        if "\0" in value:  # no file name, no name of anything, holds one
            raise ConfigError(f"{where}: {value!r} holds a NUL character")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config field {where} has an unsupported type {tp!r}")


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

_DATA_SOURCES = ("jsonl", "text", "synthetic")
_INPUT_PATHS = {("model", "path"), ("data", "jsonl"), ("data", "text"), ("data", "tokenizer")}
_OUTPUT_PATHS = {("checkpoint", "dir"), ("checkpoint", "resume"), ("output_dir",), ("log", "metrics_jsonl")}
_PATH_KEYS = _INPUT_PATHS | _OUTPUT_PATHS


def _resolve_paths(d: dict[str, Any], base: Path, keys: set[tuple[str, ...]] = _PATH_KEYS) -> dict[str, Any]:
    """Make the path-valued ``keys`` absolute relative to ``base`` (Ray workers have other cwds)."""
    out = _merge({}, d)
    for key in keys:
        node = out
        for k in key[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        value = node.get(key[-1]) if isinstance(node, dict) else None
        if isinstance(value, str) and "\0" in value:
            raise ConfigError(f"{'.'.join(key)}: {value!r} holds a NUL character", key=".".join(key))
        if isinstance(value, str) and not (key == ("checkpoint", "resume") and value in ("auto", "none")):
            node[key[-1]] = str(real_path(base / Path(value).expanduser()))
    return out


def _apply_override(target: dict[str, Any], item: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key.path=value, got {item!r}")
    try:
        value = load_yaml(raw, f"--set {item}") if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(f"--set {item}", e, position=False)) from None
    node = target
    parts = key.strip().split(".")
    if isinstance(value, int | float | datetime.date) and not isinstance(value, bool) and _takes_text(parts):
        value = raw.strip()  # a folder named 20241204 or 2024-12-04: the text typed, not YAML's number or date
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item}: {p} was set to a value, not a section, by an earlier --set")
    node[parts[-1]] = value


_EXPONENT_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number with an exponent and no dot (``1e-6``): YAML 1.1 (PyYAML) reads it as text."""


def yaml_numbers(value: Any) -> Any:
    """``value`` (a ``model.config`` mapping, say) with the numbers YAML 1.1 read as text
    (``rms_norm_eps: 1e-6``, as written in any config.json) as floats, nested ones included;
    Transformers refused them ("expected float, got str")."""
    if isinstance(value, Mapping):
        return {k: yaml_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_numbers(v) for v in value]
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _takes_text(parts: Sequence[str]) -> bool:
    """Whether the config key ``parts`` (``["data", "field"]``) holds free text (a path, a name)."""
    tp: Any = FinetuneConfig
    for p in parts:
        options = [t for t in typing.get_args(tp) if t is not type(None)] or [tp]  # X | None -> X
        if len(options) != 1 or not dataclasses.is_dataclass(options[0]):
            return False
        tp = typing.get_type_hints(options[0]).get(p)
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                         and set(typing.get_args(tp)) == {str, type(None)})


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _merge(dict(out[k]), v)
        elif isinstance(v, Mapping):
            out[k] = _merge({}, v)
        else:
            out[k] = v
    return out


def _get(d: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = d
    for p in dotted.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return default
        node = node[p]
    return node


def _canonical_names(layer: dict[str, Any], model_type: str | None) -> dict[str, Any]:
    """``layer`` with each ``model.config`` field set under another name of a field of
    ``model_type`` (Transformers' ``attribute_map``: Qwen3-MoE's ``num_experts`` is
    ``num_local_experts``) renamed to the field's own name, so that a later layer's value
    replaces an earlier layer's under either name. A layer setting both names keeps both
    (refused later when they differ)."""
    config = _get(layer, "model.config")
    if not (model_type and isinstance(config, Mapping)):
        return layer
    try:
        from transformers import CONFIG_MAPPING

        aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {}
    except (ImportError, KeyError, TypeError):  # an unknown model_type is named later
        return layer
    renamed = {aliases[k] if k in aliases and aliases[k] not in config else k: v for k, v in config.items()}
    return {**layer, "model": {**layer["model"], "config": renamed}}


def _has(d: Mapping[str, Any], dotted: str) -> bool:
    """Whether ``dotted`` is set in ``d`` (to any value, null included)."""
    *parents, last = dotted.split(".")
    for part in parents:
        d = d.get(part) if isinstance(d, Mapping) else None
    return isinstance(d, Mapping) and last in d


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def did_you_mean(word: str, options: Sequence[str] | Mapping[str, Any]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options`` to ``word``, or ``""``."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
