"""``polyaccel-moe finetune --workers 8`` (or ``--address``, ``--storage-path``) without
``--ray`` silently trained in one process; now a config error (exit 2) before anything runs,
and ``--help`` says these flags go with ``--ray``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polyaccel.moe.cli import main


@pytest.mark.parametrize("flags", [["--workers", "4"], ["--address", "127.0.0.1:6379"], ["--storage-path", "/tmp/x"]])
def test_ray_flags_without_ray_are_refused(tmp_path: Path, capsys, flags: list[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(json.dumps({"model": {"preset": "qwen3-moe-tiny"}, "output_dir": str(tmp_path / "out")}))
    assert main(["finetune", str(config), *flags]) == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} only applies with --ray" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_help_says_the_ray_flags_go_with_ray(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["finetune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--workers WORKERS with --ray:" in text and "--storage-path STORAGE_PATH with --ray:" in text
