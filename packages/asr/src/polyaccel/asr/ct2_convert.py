"""Convert a CTranslate2 Whisper checkpoint (``model.bin``) into a Hugging Face
``WhisperForConditionalGeneration`` directory (config, generation config, safetensors,
tokenizer and feature-extractor files) that loads offline.

The CTranslate2 ``model.bin`` layout (little-endian; strings are a ``uint16`` byte count
followed by that many bytes, the last one NUL)::

    uint32 binary_version            # 4..6 handled here (all share the layout below)
    string spec_name                 # "WhisperSpec"
    uint32 spec_revision
    uint32 num_variables
    num_variables x {
        string name                  # e.g. "encoder/layer_0/self_attention/linear_0/weight"
        uint8  rank;  uint32 dims[rank]
        uint8  dtype                 # 0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16
        uint32 num_bytes;  bytes data[num_bytes]
    }
    uint32 num_aliases
    num_aliases x { string alias; string target }   # "decoder/projection/weight" -> embeddings

How the variables map onto Hugging Face names (per layer ``i``):

=====================================================  ==============================================
CTranslate2                                            Hugging Face (``model.`` prefix)
=====================================================  ==============================================
encoder/conv{1,2}/{weight,bias}                        encoder.conv{1,2}.*
encoder/position_encodings/encodings                   encoder.embed_positions.weight
encoder/layer_i/self_attention/linear_0 (fused Q|K|V)  encoder.layers.i.self_attn.{q,k,v}_proj (K bias is zero, dropped)
encoder/layer_i/self_attention/linear_1                encoder.layers.i.self_attn.out_proj
encoder/layer_i/self_attention/layer_norm              encoder.layers.i.self_attn_layer_norm
encoder/layer_i/ffn/linear_{0,1}, ffn/layer_norm       encoder.layers.i.fc{1,2}, final_layer_norm
encoder/layer_norm                                     encoder.layer_norm
decoder/embeddings/weight                              decoder.embed_tokens.weight (= proj_out, tied)
decoder/position_encodings/encodings                   decoder.embed_positions.weight
decoder/layer_i/self_attention/...                     decoder.layers.i.self_attn... (as the encoder)
decoder/layer_i/attention/linear_0                     decoder.layers.i.encoder_attn.q_proj
decoder/layer_i/attention/linear_1 (fused K|V)         decoder.layers.i.encoder_attn.{k,v}_proj
decoder/layer_i/attention/linear_2                     decoder.layers.i.encoder_attn.out_proj
decoder/layer_i/attention/layer_norm                   decoder.layers.i.encoder_attn_layer_norm
=====================================================  ==============================================

Layer norms are ``gamma``/``beta`` -> ``weight``/``bias``. Scalars (``num_heads``,
``activation``, ``pre_norm``...) are read for the config and not stored as tensors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from polyaccel.asr.config_limits import read_json_object
from polyaccel.core.files import missing_dirs, remove_empty_dirs

SUPPORTED_BINARY_VERSIONS = (4, 5, 6)
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


class CT2FormatError(ValueError):
    """The file is not a CTranslate2 Whisper model this converter understands."""


@dataclasses.dataclass(slots=True)
class CT2Model:
    """The parsed contents of a CTranslate2 ``model.bin``.

    ``variables`` maps names to arrays (tensors and scalar attributes alike); ``aliases``
    maps alias names to the variable they share storage with.
    """

    binary_version: int
    spec_name: str
    spec_revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def tensor(self, name: str) -> torch.Tensor:
        """The variable ``name`` (following aliases) as a float32 torch tensor."""
        name = self.aliases.get(name, name)
        try:
            arr = self.variables[name]
        except KeyError:
            raise CT2FormatError(f"variable {name!r} missing from the CTranslate2 model") from None
        return torch.from_numpy(arr.astype(np.float32))  # a copy: the buffer is read-only

    def scalar(self, name: str, default: int | None = None) -> int | None:
        arr = self.variables.get(name)
        return default if arr is None else int(arr.reshape(-1)[0])

    def num_layers(self, stack: str) -> int:
        pat = re.compile(rf"^{stack}/layer_(\d+)/")
        idx = {int(m.group(1)) for n in self.variables if (m := pat.match(n))}
        if idx != set(range(len(idx))):
            raise CT2FormatError(f"{stack} layers are not numbered 0..N-1: {sorted(idx)}")
        return len(idx)


# ---- reading model.bin ---------------------------------------------------------------

class _Reader:
    """Bounds-checked little-endian reads over a bytes buffer."""

    def __init__(self, buf: bytes | memoryview, source: str) -> None:
        self.buf = memoryview(buf)
        self.pos = 0
        self.source = source

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CT2FormatError(f"{self.source}: truncated file: needed {n} bytes for {what} at offset "
                                 f"{self.pos}, only {len(self.buf) - self.pos} left")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("H", f"length of {what}")
        raw = bytes(self.take(n, what))
        return raw.rstrip(b"\0").decode("utf-8")


def read_ct2_model(parts: str | os.PathLike | Sequence[str | os.PathLike]) -> CT2Model:
    """Parse a CTranslate2 model: a ``model.bin``, a directory holding one (or
    ``model.bin.part1``, ``.part2``...), or an explicit list of parts to concatenate in order.
    """
    files = _model_bin_parts(parts)
    buf = b"".join(Path(f).read_bytes() for f in files) if len(files) > 1 else Path(files[0]).read_bytes()
    src = str(files[0]) if len(files) == 1 else f"{files[0]} (+{len(files) - 1} parts)"
    r = _Reader(buf, src)
    version = r.unpack("I", "binary version")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise CT2FormatError(f"{src}: unsupported CTranslate2 binary version {version} (this converter reads "
                             f"versions {SUPPORTED_BINARY_VERSIONS}); is it a CTranslate2 model.bin?")
    spec = r.string("spec name")
    revision = r.unpack("I", "spec revision")
    if spec != "WhisperSpec":
        raise CT2FormatError(f"{src}: spec {spec!r} is not a Whisper model (expected 'WhisperSpec')")
    variables: dict[str, np.ndarray] = {}
    for _ in range(r.unpack("I", "variable count")):
        name = r.string("variable name")
        rank = r.unpack("B", f"rank of {name}")
        shape = tuple(r.unpack("I", f"shape of {name}") for _ in range(rank))
        dtype_id = r.unpack("B", f"dtype of {name}")
        nbytes = r.unpack("I", f"size of {name}")
        data = r.take(nbytes, f"data of {name}")
        if dtype_id not in _DTYPES:
            raise CT2FormatError(f"{src}: variable {name!r} has unknown dtype id {dtype_id}")
        variables[name] = _to_array(data, _DTYPES[dtype_id], shape, name, src)
    aliases = {}
    if r.pos < len(r.buf):
        for _ in range(r.unpack("I", "alias count")):
            alias = r.string("alias name")
            aliases[alias] = r.string("alias target")
    if r.pos != len(r.buf):
        raise CT2FormatError(f"{src}: {len(r.buf) - r.pos} unexpected trailing bytes")
    if any(n.endswith("weight_scale") for n in variables):
        raise CT2FormatError(f"{src}: int8-quantized CTranslate2 models are not supported; "
                             f"use one converted with --quantization float16 or float32")
    return CT2Model(version, spec, revision, variables, aliases)


def _to_array(data: memoryview, dtype, shape: tuple[int, ...], name: str, src: str) -> np.ndarray:
    if dtype == "bfloat16":  # numpy has no bfloat16: widen the 16 high bits to float32
        raw = np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16
        arr = raw.view(np.float32)
    else:
        arr = np.frombuffer(data, dtype=dtype)
    if arr.size != int(np.prod(shape, dtype=np.int64)):
        raise CT2FormatError(f"{src}: variable {name!r}: {arr.size} elements for shape {shape}")
    return arr.reshape(shape)


def _model_bin_parts(src: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if not isinstance(src, (str, os.PathLike)):
        files = [Path(p) for p in src]
        if not files:
            raise FileNotFoundError("no model.bin parts given")
    else:
        p = Path(src)
        if p.is_dir():
            if (p / "model.bin").is_file():
                files = [p / "model.bin"]
            else:
                files = sorted(p.glob("model.bin.part*"), key=lambda f: int(re.sub(r"\D", "", f.suffix) or 0))
                if not files:
                    raise FileNotFoundError(f"{p}: no model.bin (or model.bin.partN) in this directory")
        else:
            files = [p]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: no such file")
    return files


# ---- mapping to Hugging Face ------------------------------------------------------------

def _ln(m: CT2Model, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    out[f"{dst}.weight"] = m.tensor(f"{src}/gamma")
    out[f"{dst}.bias"] = m.tensor(f"{src}/beta")


def _linear(m: CT2Model, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    out[f"{dst}.weight"] = m.tensor(f"{src}/weight")
    out[f"{dst}.bias"] = m.tensor(f"{src}/bias")


def _split_fused(m: CT2Model, src: str, dsts: list[str], out: dict[str, torch.Tensor]) -> None:
    """Split a fused projection into equal parts; the ``k_proj`` part's bias must be zero."""
    w = m.tensor(f"{src}/weight").chunk(len(dsts), dim=0)
    b = m.tensor(f"{src}/bias").chunk(len(dsts), dim=0)
    for dst, wi, bi in zip(dsts, w, b, strict=True):
        out[f"{dst}.weight"] = wi.contiguous()
        if dst.endswith("k_proj"):
            if bi.abs().max().item() != 0.0:
                raise CT2FormatError(f"{src}: the K bias is not zero; Whisper's k_proj has no bias")
        else:
            out[f"{dst}.bias"] = bi.contiguous()


def _self_attention_and_ffn(m: CT2Model, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    """The parts every Whisper layer has: fused-QKV self-attention, its LayerNorm, the MLP and
    its LayerNorm (CT2 prefix ``src`` -> HF prefix ``dst``)."""
    _split_fused(m, f"{src}/self_attention/linear_0", [f"{dst}.self_attn.{p}_proj" for p in "qkv"], out)
    _linear(m, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj", out)
    _ln(m, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm", out)
    _linear(m, f"{src}/ffn/linear_0", f"{dst}.fc1", out)
    _linear(m, f"{src}/ffn/linear_1", f"{dst}.fc2", out)
    _ln(m, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm", out)


def ct2_to_hf_state_dict(m: CT2Model) -> dict[str, torch.Tensor]:
    """Hugging Face ``WhisperForConditionalGeneration`` tensors (fp32) from a parsed model.

    ``proj_out.weight`` is tied to ``model.decoder.embed_tokens.weight`` and not included.
    """
    out: dict[str, torch.Tensor] = {}
    for conv in ("conv1", "conv2"):
        _linear(m, f"encoder/{conv}", f"model.encoder.{conv}", out)
    out["model.encoder.embed_positions.weight"] = m.tensor("encoder/position_encodings/encodings")
    for i in range(m.num_layers("encoder")):
        _self_attention_and_ffn(m, f"encoder/layer_{i}", f"model.encoder.layers.{i}", out)
    _ln(m, "encoder/layer_norm", "model.encoder.layer_norm", out)

    out["model.decoder.embed_tokens.weight"] = m.tensor("decoder/embeddings/weight")
    out["model.decoder.embed_positions.weight"] = m.tensor("decoder/position_encodings/encodings")
    for i in range(m.num_layers("decoder")):
        s, d = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        _self_attention_and_ffn(m, s, d, out)
        _linear(m, f"{s}/attention/linear_0", f"{d}.encoder_attn.q_proj", out)
        _split_fused(m, f"{s}/attention/linear_1", [f"{d}.encoder_attn.{p}_proj" for p in "kv"], out)
        _linear(m, f"{s}/attention/linear_2", f"{d}.encoder_attn.out_proj", out)
        _ln(m, f"{s}/attention/layer_norm", f"{d}.encoder_attn_layer_norm", out)
    _ln(m, "decoder/layer_norm", "model.decoder.layer_norm", out)

    proj = m.aliases.get("decoder/projection/weight", "decoder/projection/weight")
    if proj != "decoder/embeddings/weight" and proj in m.variables:
        if not torch.equal(m.tensor(proj), out["model.decoder.embed_tokens.weight"]):
            raise CT2FormatError("decoder/projection/weight differs from the embeddings; "
                                 "Whisper ties proj_out to embed_tokens")
    return out


# ---- configs and tokenizer files -------------------------------------------------------

@dataclasses.dataclass(slots=True)
class _SpecialTokens:
    eot: int
    sot: int
    translate: int
    transcribe: int
    prev: int
    no_timestamps: int
    languages: dict[str, int]  # "<|en|>" -> id

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> _SpecialTokens:
        added = {t["content"]: t["id"] for t in read_json_object(path, CT2FormatError)["added_tokens"]}
        need = ["<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>",
                "<|startofprev|>", "<|notimestamps|>"]
        missing = [t for t in need if t not in added]
        if missing:
            raise CT2FormatError(f"{path}: special tokens {missing} missing; not a Whisper tokenizer")
        sot, translate = added["<|startoftranscript|>"], added["<|translate|>"]
        lang_re = re.compile(r"^<\|[a-z]{2,3}\|>$")  # <|en|>, <|haw|>, <|yue|>
        langs = {c: i for c, i in added.items() if sot < i < translate and lang_re.match(c)}
        return cls(added["<|endoftext|>"], sot, translate, added["<|transcribe|>"],
                   added["<|startofprev|>"], added["<|notimestamps|>"], langs)


def hf_configs(m: CT2Model, ct2_config: dict, tokens: _SpecialTokens) -> tuple[dict, dict, dict]:
    """(config.json, generation_config.json, preprocessor_config.json) for the checkpoint.

    Dimensions come from tensor shapes; token ids from the tokenizer; suppression lists and
    alignment heads from CTranslate2's ``config.json``.
    """
    vocab, d_model = m.variables["decoder/embeddings/weight"].shape
    n_mels = m.variables["encoder/conv1/weight"].shape[1]
    multilingual = vocab >= 51865
    if multilingual != (tokens.eot == 50257):
        raise CT2FormatError(f"vocabulary size {vocab} and tokenizer (<|endoftext|> = {tokens.eot}) disagree "
                             f"on whether the model is multilingual")
    enc_heads = m.scalar("encoder/num_heads", d_model // 64)
    dec_heads = m.scalar("decoder/num_heads", d_model // 64)
    suppress = [int(t) for t in ct2_config.get("suppress_ids", [])]
    begin_suppress = [int(t) for t in ct2_config.get("suppress_ids_begin", [220, tokens.eot])]
    alignment_heads = [[int(a), int(b)] for a, b in ct2_config.get("alignment_heads", [])]
    if multilingual:
        forced = [[1, None], [2, tokens.transcribe]]
    else:
        forced = [[1, tokens.no_timestamps]]
    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": int(vocab),
        "num_mel_bins": int(n_mels),
        "d_model": int(d_model),
        "encoder_layers": m.num_layers("encoder"),
        "encoder_attention_heads": enc_heads,
        "encoder_ffn_dim": int(m.variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "decoder_layers": m.num_layers("decoder"),
        "decoder_attention_heads": dec_heads,
        "decoder_ffn_dim": int(m.variables["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        "num_hidden_layers": m.num_layers("encoder"),
        "max_source_positions": int(m.variables["encoder/position_encodings/encodings"].shape[0]),
        "max_target_positions": int(m.variables["decoder/position_encodings/encodings"].shape[0]),
        "activation_function": "gelu",
        "scale_embedding": False,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "init_std": 0.02,
        "is_encoder_decoder": True,
        "use_cache": True,
        "tie_word_embeddings": True,
        "bos_token_id": tokens.eot, "eos_token_id": tokens.eot, "pad_token_id": tokens.eot,
        "decoder_start_token_id": tokens.sot,
        "begin_suppress_tokens": begin_suppress,
        "suppress_tokens": suppress,
        "dtype": "float32",
    }
    generation = {
        "alignment_heads": alignment_heads,
        "begin_suppress_tokens": begin_suppress,
        "bos_token_id": tokens.eot,
        "decoder_start_token_id": tokens.sot,
        "eos_token_id": tokens.eot,
        "pad_token_id": tokens.eot,
        "forced_decoder_ids": forced,
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": 50,
        "max_length": config["max_target_positions"],
        "no_timestamps_token_id": tokens.no_timestamps,
        "prev_sot_token_id": tokens.prev,
        "return_timestamps": False,
        "suppress_tokens": suppress,
    }
    if multilingual:
        generation["lang_to_id"] = tokens.languages
        generation["task_to_id"] = {"transcribe": tokens.transcribe, "translate": tokens.translate}
    preprocessor = {
        "chunk_length": 30,
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": int(n_mels),
        "hop_length": 160,
        "n_fft": 400,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "processor_class": "WhisperProcessor",
        "return_attention_mask": False,
        "sampling_rate": 16000,
    }
    return config, generation, preprocessor


def _tokenizer_files() -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json so WhisperTokenizer(Fast) loads offline."""
    special = "<|endoftext|>"
    tok_config = {
        "tokenizer_class": "WhisperTokenizer",
        "bos_token": special, "eos_token": special, "unk_token": special, "pad_token": special,
        "add_prefix_space": False,
        "errors": "replace",
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "processor_class": "WhisperProcessor",
    }
    special_map = {"bos_token": special, "eos_token": special, "unk_token": special, "pad_token": special}
    return {"tokenizer_config.json": tok_config, "special_tokens_map.json": special_map}


# ---- the whole conversion ------------------------------------------------------------------

def convert_ct2_whisper(src: str | os.PathLike | Sequence[str | os.PathLike], out_dir: str | os.PathLike, *,
                        assets_dir: str | os.PathLike | None = None) -> Path:
    """Write a Hugging Face Whisper directory at ``out_dir`` from a CTranslate2 model.

    ``src`` is a CTranslate2 model directory, a ``model.bin``, or the list of its
    ``model.bin.partN`` files in order. ``assets_dir`` holds CTranslate2's ``config.json`` and
    ``tokenizer.json`` (default: the directory of ``src``, or of its first part).
    ``out_dir`` is created (it must not hold another model); returns it.
    """
    from safetensors.torch import save_file

    assets = _assets_dir(src, assets_dir)
    out = Path(out_dir)
    _check_new_dir(out)
    _model_bin_parts(src)  # a missing source is said as such, before its assets
    tokenizer_json = assets / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{assets}: tokenizer.json missing (needed next to the CTranslate2 model)")
    ct2_cfg_path = assets / "config.json"
    ct2_config = read_json_object(ct2_cfg_path, CT2FormatError) if ct2_cfg_path.is_file() else {}

    model = read_ct2_model(src)
    tokens = _SpecialTokens.from_tokenizer_json(tokenizer_json)
    config, generation, preprocessor = hf_configs(model, ct2_config, tokens)
    state = ct2_to_hf_state_dict(model)

    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    files = {"config.json": config, "generation_config.json": generation,
             "preprocessor_config.json": preprocessor,
             **_tokenizer_files()}
    for name, obj in files.items():
        (out / name).write_text(json.dumps(obj, indent=2) + "\n")
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    return out


def _assets_dir(src: str | os.PathLike | Sequence[str | os.PathLike],
                assets_dir: str | os.PathLike | None) -> Path:
    """``assets_dir``, or by default the directory of ``src`` (or of its first part)."""
    if assets_dir is not None:
        return Path(assets_dir)
    first = Path(src) if isinstance(src, (str, os.PathLike)) else Path(list(src)[0])
    return first if first.is_dir() else first.parent


def source_files(src: str | os.PathLike | Sequence[str | os.PathLike], *,
                 assets_dir: str | os.PathLike | None = None) -> list[Path]:
    """Every file :func:`convert_ct2_whisper` reads for these arguments: the ``model.bin``
    parts in order, then ``tokenizer.json`` and ``config.json`` where they exist."""
    assets = _assets_dir(src, assets_dir)
    extra = [f for f in (assets / "tokenizer.json", assets / "config.json") if f.is_file()]
    return [*_model_bin_parts(src), *extra]


STALE_TEMP_S = 30 * 60
"""A hidden temporary folder of a conversion untouched this long was left by a killed one."""


def stale_temp(path: Path, older_than_s: float) -> bool:
    """A real folder of ours whose newest entry (or itself) changed over ``older_than_s`` ago."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        newest = max([st.st_mtime, *(os.lstat(e.path).st_mtime for e in os.scandir(path))])
    except OSError:
        return False
    return time.time() - newest > older_than_s


def _check_new_dir(out: Path) -> None:
    """Refuse an ``out`` that exists and is not an empty folder (a symbolic link even to one:
    the new folder would be renamed over the link): converting never replaces files."""
    if out.is_symlink():
        raise FileExistsError(f"{out} is a symbolic link; converting writes a new folder and replaces nothing "
                              "(give the folder it leads to)")
    if out.is_dir() and not any(out.iterdir()):
        return
    if os.path.lexists(out):
        what = "is a folder that is not empty" if out.is_dir() else "exists and is not a folder"
        raise FileExistsError(f"{out} {what}; converting writes a new folder and replaces nothing")


def _remove_killed_conversions(out: Path) -> None:
    """Remove the ``.OUT.<12 hex>`` folders beside ``out`` that killed conversions to it left
    (:func:`stale_temp`: real folders of this user, untouched for :data:`STALE_TEMP_S`)."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.[0-9a-f]{{12}}")
    try:
        entries = list(os.scandir(out.parent))
    except OSError:
        return
    for e in entries:
        if pattern.fullmatch(e.name) and stale_temp(Path(e.path), STALE_TEMP_S):
            shutil.rmtree(e.path, ignore_errors=True)  # does not follow symlinks inside


def main(argv: Sequence[str] | None = None) -> int:
    """``polyaccel-asr convert SRC OUT``: the CLI calls this (or :func:`convert_ct2_whisper`).
    OUT must be new (or an empty folder); it appears complete or not at all. Exit status 0, or
    2 with the reason (bad or missing source, an OUT that exists)."""
    import argparse
    import secrets
    import sys

    p = argparse.ArgumentParser(prog="polyaccel-asr convert",
                                description="Convert a CTranslate2 Whisper model to a new Hugging Face directory "
                                            "(OUT must not exist, or be an empty folder).")
    p.add_argument("src", nargs="+", help="CTranslate2 model dir, model.bin, or model.bin.partN files in order")
    p.add_argument("out", help="output directory (new, or empty)")
    p.add_argument("--assets-dir", help="directory with CTranslate2's config.json and tokenizer.json")
    a = p.parse_args(argv)
    src = a.src[0] if len(a.src) == 1 else a.src
    out = Path(a.out)
    tmp = None
    made = missing_dirs(out.absolute().parent)
    try:
        _check_new_dir(out)
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        _remove_killed_conversions(out.absolute())
        tmp = out.absolute().parent / f".{out.absolute().name}.{secrets.token_hex(6)}"
        tmp.mkdir(0o777)  # the umask applies (mkdtemp's 0700 would hide the model from other users)
        convert_ct2_whisper(src, tmp, assets_dir=a.assets_dir)
        _check_new_dir(out)
        os.rename(tmp, out)
    except (OSError, ValueError, KeyError, TypeError) as e:
        reason = f"{e.args[0]!r} missing from the model or its tokenizer.json" if isinstance(e, KeyError) else e
        from polyaccel.asr.results_file import printable

        print(f"polyaccel-asr convert: error: {printable(reason)}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():  # failed: no empty folders left by it either
            remove_empty_dirs(made)
    print(out)
    return 0

