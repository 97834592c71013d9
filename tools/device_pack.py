"""Carry files over the device tool's per-call limit: pack here, stage there, unpack there.

The device machine takes at most 64 MiB of git-ignored files per call, and only folders that
the repository's ``.gitignore`` ignores survive between back-to-back calls. So:

  # here: one tar of the given files/folders, cut into parts of at most --part-mib
  python3 tools/device_pack.py pack OUTDIR SRC... [--part-mib 60]
      -> OUTDIR/part-000 ... and OUTDIR/manifest.json (sizes and sha256 of the tar and parts)

  # there, once per call, carrying one part (e.g. carry=["OUTDIR/part-001"]): keep it
  python3 tools/device_pack.py stage OUTDIR            # moves OUTDIR/part-* into .cache/device_pack/

  # there, in the last call: check every part and the whole, then unpack
  python3 tools/device_pack.py unpack DEST             # -> DEST/<the packed names>

Real Whisper weights for the GPU runs (docs/benchmarks.md, "Getting the weights there"): pack the
model folder, the LibriVox clips and the wheels the GPU image lacks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

STAGE = Path(".cache/device_pack")  # ignored by .gitignore: survives between calls


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


PART = re.compile(r"part-\d{3,}")


def _earlier_pack(outdir: Path) -> list[Path]:
    """The files of an earlier pack in ``outdir`` (its manifest and parts), which a new pack
    replaces. Raises ``SystemExit`` if ``outdir`` holds a ``manifest.json`` or ``part-NNN``
    that no pack of this tool wrote (a user's file is never overwritten) or a link."""
    manifest, parts = outdir / "manifest.json", [p for p in outdir.glob("part-*") if PART.fullmatch(p.name)]
    if not manifest.exists() and not manifest.is_symlink():
        if parts:
            raise SystemExit(f"{outdir} holds {parts[0].name} but no manifest.json: not a pack's; choose another OUTDIR")
        return []
    try:
        listed = {part["name"] for part in json.loads(manifest.read_text())["parts"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{manifest} is not a pack's manifest ({e!r}); choose another OUTDIR") from None
    foreign = [p.name for p in [manifest, *parts] if p.is_symlink() or not p.is_file()]
    foreign += [p.name for p in parts if p.name not in listed]
    if foreign:
        raise SystemExit(f"{outdir}: {', '.join(foreign)} not written by this tool's last pack there; "
                         "choose another OUTDIR")
    return [manifest, *parts]


def pack(outdir: Path, sources: list[Path], part_bytes: int) -> dict:
    """Tar ``sources`` (each under its own name) and cut the tar into parts in ``outdir``,
    replacing an earlier pack there (never a user's file: :func:`_earlier_pack`)."""
    inside = [str(s) for s in sources if outdir.resolve().is_relative_to(s.resolve())]
    if inside:
        raise SystemExit(f"OUTDIR {outdir} is inside {', '.join(inside)}: the pack would hold itself")
    outdir.mkdir(parents=True, exist_ok=True)
    for old in _earlier_pack(outdir):  # no stale part of a longer pack is left to stage
        old.unlink()
    fd, name = tempfile.mkstemp(prefix=".pack-", suffix=".tar", dir=outdir)  # never a file of the user's
    os.close(fd)
    whole = Path(name)
    try:
        with tarfile.open(whole, "w") as tar:
            for src in sources:
                tar.add(src, arcname=src.name)
        names = [f"part-{i:03d}" for i in range(-(-whole.stat().st_size // part_bytes))]
        # The names are claimed first: parts left by a kill belong to this pack, a rerun replaces them.
        (outdir / "manifest.json").write_text(json.dumps({"tar_sha256": None, "parts": [
            {"name": n, "sha256": None} for n in names]}))
        parts = []
        with open(whole, "rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
                part = outdir / f"part-{i:03d}"
                part.write_bytes(chunk)
                parts.append({"name": part.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
        manifest = {"tar_sha256": _sha256(whole), "tar_bytes": whole.stat().st_size, "parts": parts}
    finally:
        whole.unlink(missing_ok=True)
    (outdir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def stage(outdir: Path, stage_dir: Path = STAGE) -> list[str]:
    """Move the parts (``part-NNN``) and the manifest found in ``outdir`` into ``stage_dir``."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    moved = []
    for p in sorted(p for p in outdir.glob("part-*") if PART.fullmatch(p.name)) + sorted(outdir.glob("manifest.json")):
        shutil.move(str(p), stage_dir / p.name)
        moved.append(p.name)
    return moved


def unpack(dest: Path, stage_dir: Path = STAGE) -> list[str]:
    """Check each staged part and the joined tar against the manifest, then extract to ``dest``.
    Raises ``SystemExit`` naming what is missing or corrupt; nothing is extracted then."""
    manifest_path = stage_dir / "manifest.json"
    if not manifest_path.is_file():
        raise SystemExit(f"{manifest_path} missing: stage the manifest with one of the parts")
    manifest = json.loads(manifest_path.read_text())
    foreign = [str(part["name"]) for part in manifest["parts"] if not PART.fullmatch(str(part["name"]))]
    if foreign:  # "../x" or "/x" would join files outside the stage folder into the tar
        raise SystemExit(f"{manifest_path} names {foreign[0]!r}, not a part-NNN in {stage_dir}: refused")
    h = hashlib.sha256()
    for part in manifest["parts"]:
        path = stage_dir / part["name"]
        if not path.is_file():
            raise SystemExit(f"{part['name']} not staged yet ({len(manifest['parts'])} parts in all)")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != part["sha256"]:
            raise SystemExit(f"{part['name']}: sha256 differs from the manifest (corrupt or from another pack)")
        h.update(data)
    if h.hexdigest() != manifest["tar_sha256"]:
        raise SystemExit("the joined parts' sha256 differs from the manifest")
    dest.mkdir(parents=True, exist_ok=True)
    whole = stage_dir / "pack.tar"
    with open(whole, "wb") as out:
        for part in manifest["parts"]:
            out.write((stage_dir / part["name"]).read_bytes())
    with tarfile.open(whole) as tar:
        names = sorted({m.name.split("/")[0] for m in tar.getmembers()})
        tar.extractall(dest, filter="data")
    whole.unlink()
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="tar SRC... and cut it into parts in OUTDIR")
    pk.add_argument("outdir", type=Path)
    pk.add_argument("sources", type=Path, nargs="+")
    pk.add_argument("--part-mib", type=float, default=60.0, help="largest part (the carry limit is 64 MiB a call)")
    st = sub.add_parser("stage", help="move OUTDIR's parts into .cache/device_pack (kept between calls)")
    st.add_argument("outdir", type=Path)
    up = sub.add_parser("unpack", help="check the staged parts and extract them into DEST")
    up.add_argument("dest", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "pack":
        missing = [str(s) for s in a.sources if not s.exists()]
        if missing:
            raise SystemExit(f"no such file or folder: {', '.join(missing)}")
        m = pack(a.outdir, a.sources, int(a.part_mib * 2**20))
        print(json.dumps({"parts": len(m["parts"]), "tar_bytes": m["tar_bytes"], "tar_sha256": m["tar_sha256"]}))
    elif a.cmd == "stage":
        print(json.dumps({"staged": stage(a.outdir)}))
    else:
        print(json.dumps({"unpacked": unpack(a.dest)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
