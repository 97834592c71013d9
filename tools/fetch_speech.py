"""Put the five LibriVox sample clips into this environment (``make setup`` runs it).

Downloads PocketSphinx's source release pinned by hash in ``requirements/speech.txt`` with
pip (nothing is built or installed) and unpacks only ``test/data/librivox/*.wav`` and its
``transcription`` into ``<venv>/share/polyaccel/librivox``. Does nothing when they are there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from polyaccel.asr.samples import is_complete, venv_librivox

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "test/data/librivox/"


def download_sdist(dest: Path) -> Path:
    """``pip download`` the hash-pinned sdist into ``dest``; return its path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "pocketsphinx",
                    "--require-hashes", "-r", str(ROOT / "requirements/speech.txt"),
                    "--build-constraint", str(ROOT / "requirements/speech-build.txt"), "-d", str(dest)],
                   check=True)
    (sdist,) = dest.glob("pocketsphinx-*.tar.gz")
    return sdist


def wanted(name: str) -> bool:
    """The clips and their transcription, nothing else of the source tree."""
    _, _, rest = name.partition("/")
    if not rest.startswith(PREFIX) or "/" in rest[len(PREFIX):]:
        return False
    leaf = rest[len(PREFIX):]
    return leaf.endswith(".wav") or leaf == "transcription"


def unpack(sdist: Path, out: Path) -> list[str]:
    """Copy the wanted members of ``sdist`` into ``out``; return their names."""
    out.mkdir(parents=True, exist_ok=True)
    names = []
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            if m.isfile() and wanted(m.name):
                leaf = Path(m.name).name
                (out / leaf).write_bytes(tar.extractfile(m).read())
                names.append(leaf)
    return sorted(names)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=venv_librivox())
    args = p.parse_args()
    if is_complete(args.out):
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        names = unpack(download_sdist(Path(tmp)), args.out)
    if not is_complete(args.out):
        print(f"no LibriVox clips found in the pocketsphinx sdist (got {names})", file=sys.stderr)
        return 1
    print(f"{len(names) - 1} LibriVox clips in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
