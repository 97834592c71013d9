"""Fixtures shared by the ASR tests: real speech and Transformers' Whisper, loaded once per session,
and ``asr_cli``, the helpers of the ``polyaccel-asr`` CLI tests. (Test files cannot import a sibling
module here: pytest runs with ``--import-mode=importlib``.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from polyaccel.asr import samples


@pytest.fixture(scope="session")
def librivox_clips() -> list[np.ndarray]:
    """The five LibriVox clips (16 kHz mono float32), in file-name order; skips without them."""
    import soundfile as sf

    folder = samples.librivox_dir()
    if folder is None:
        pytest.skip(f"LibriVox clips missing: {samples.INSTALL_HINT}")
    return [sf.read(f, dtype="float32")[0] for f in sorted(folder.glob("*.wav"))]


@pytest.fixture(scope="session")
def hf_whisper():
    """``hf_whisper(path)``: (``WhisperProcessor``, fp32 ``WhisperForConditionalGeneration``) of
    a converted folder, loaded once per session (tests must not change them)."""
    import torch
    import transformers

    loaded = {}

    def get(path):
        key = str(path)
        if key not in loaded:
            loaded[key] = (transformers.WhisperProcessor.from_pretrained(path),
                           transformers.WhisperForConditionalGeneration.from_pretrained(
                               path, dtype=torch.float32).eval())
        return loaded[key]

    return get


class AsrCli:
    """What the CLI tests repeat: write a small WAV file, run ``polyaccel-asr transcribe -q``, read
    a results file."""

    SR = 16000

    @staticmethod
    def wav(path: Path | bytes, seconds: float = 0.1, value: float = 0.1) -> Path | bytes:
        """``seconds`` of the constant ``value`` as a 16 kHz mono WAV file at ``path`` (WAV whatever
        its name: a name that is not ``.wav`` or not UTF-8 bytes is written too); returns ``path``."""
        import soundfile as sf

        sf.write(path, np.full(int(AsrCli.SR * seconds), value, np.float32), AsrCli.SR, format="WAV")
        return path

    @staticmethod
    def run(*argv: str) -> int:
        """``polyaccel-asr transcribe ARGV -q`` in this process; its exit status."""
        from polyaccel.asr import cli

        return cli.main(["transcribe", *argv, "-q"])

    @staticmethod
    def run_with_model(tmp_path: Path, model: Path, capsys: pytest.CaptureFixture) -> tuple[int, str, Path]:
        """``transcribe`` of a short WAV with ``--model model`` on the CPU backend, in this
        process: (exit status, what it wrote to stderr, the ``-o`` path)."""
        from polyaccel.asr import cli

        out = tmp_path / "out.jsonl"
        capsys.readouterr()
        rc = cli.main(["transcribe", str(AsrCli.wav(tmp_path / "a.wav")), "-o", str(out), "-q", "--backend", "cpu",
                       "--model", str(model)])
        return rc, capsys.readouterr().err, out

    @staticmethod
    def results(path: Path) -> list[dict]:
        """Every line of a JSONL results file, parsed."""
        return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def asr_cli() -> AsrCli:
    """``asr_cli.wav(path)``, ``asr_cli.run(*argv)``, ``asr_cli.results(path)``: see ``AsrCli``."""
    return AsrCli()
