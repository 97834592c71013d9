"""Where the five LibriVox sample clips (and their Sphinx ``transcription``) live.

``make setup`` unpacks them from PocketSphinx's pinned PyPI source release into
``<venv>/share/polyaccel/librivox`` (``tools/fetch_speech.py``); Debian's
``pocketsphinx-testdata`` is the fallback. ``$POLYACCEL_LIBRIVOX`` overrides both.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEBIAN_LIBRIVOX = Path("/usr/share/pocketsphinx/test/data/librivox")
INSTALL_HINT = "run `make setup` (python tools/fetch_speech.py), or apt-get install pocketsphinx-testdata"


def venv_librivox() -> Path:
    """Where ``tools/fetch_speech.py`` puts the clips for this interpreter's environment."""
    return Path(sys.prefix) / "share" / "polyaccel" / "librivox"


def candidates() -> list[Path]:
    """Folders searched, in order."""
    env = os.environ.get("POLYACCEL_LIBRIVOX")
    return [*([Path(env)] if env else []), venv_librivox(), DEBIAN_LIBRIVOX]


def is_complete(folder: Path) -> bool:
    """A folder with the clips and their ``transcription``."""
    return (folder / "transcription").is_file() and any(folder.glob("*.wav"))


def librivox_dir() -> Path | None:
    """The first folder that holds the clips, or None."""
    return next((d for d in candidates() if is_complete(d)), None)
