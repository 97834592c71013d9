"""``Trainer(...).train(resume_from_checkpoint=True)`` picks the newest complete checkpoint by
reading each one's ``trainer_state.json``: a FIFO there (or a link to an endless device) made
that pick block forever or read the device into memory; it is now an incomplete checkpoint,
skipped with the usual warning."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from polyaccel.moe.trainer import newest_complete_checkpoint

PLANT = {
    "fifo": lambda p: os.mkfifo(p),
    "link to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
}


@pytest.mark.parametrize("plant", PLANT)
def test_a_special_trainer_state_is_skipped_not_read(tmp_path: Path, caplog, plant: str) -> None:
    for step in (2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    PLANT[plant](tmp_path / "checkpoint-3" / "trainer_state.json")
    found: list = []
    t = threading.Thread(target=lambda: found.append(newest_complete_checkpoint(tmp_path)), daemon=True)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe"):
        t.start()
        t.join(30)
    assert not t.is_alive(), "newest_complete_checkpoint blocked on a planted trainer_state.json"
    assert found == [str(tmp_path / "checkpoint-2")]
    assert "checkpoint-3 has no trainer_state.json" in caplog.text


def test_a_trainer_state_that_is_a_link_to_a_file_still_counts(tmp_path: Path) -> None:
    """Checkpoints laid out as links to files (a Hub snapshot's layout) still resume."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "blob").write_text(json.dumps({"global_step": 4}))
    (tmp_path / "checkpoint-4" / "trainer_state.json").symlink_to(tmp_path / "blob")
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")
