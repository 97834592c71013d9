"""libnrt is loaded (its code runs in our process) only from folders nobody but us or root can
change: a folder anywhere above it that another user may write lets them rename the folder
below it and put one with their own libnrt in its place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polyaccel.neuron import nrt

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")


def library_under(tmp_path: Path) -> tuple[Path, Path]:
    """``tmp_path/shared/lib/libnrt.so.1`` (folders 0755, file 0755); returns (file, shared)."""
    shared = tmp_path / "shared"
    (shared / "lib").mkdir(parents=True)
    so = shared / "lib" / "libnrt.so.1"
    so.write_bytes(b"")
    so.chmod(0o755)
    return so, shared


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_above_the_library_that_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    so, shared = library_under(tmp_path)
    shared.chmod(mode)
    with pytest.raises(OSError, match=rf"folder {shared} is owned by uid \d+ with mode {mode:o}") as refused:
        nrt.check_trusted_library(str(so))
    assert f"chmod go-w {shared}" in str(refused.value) and "must not be writable by others" in str(refused.value)
    shared.chmod(0o755)
    assert nrt.check_trusted_library(str(so)) == str(so)


def test_load_refuses_a_libnrt_below_a_folder_others_can_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through NEURON_RT_LIB, as a user sets it: refused before dlopen."""
    so, shared = library_under(tmp_path)
    shared.chmod(0o777)
    monkeypatch.setenv("NEURON_RT_LIB", str(so))
    with pytest.raises(OSError, match=f"folder {shared} "):
        nrt.load()
    shared.chmod(0o755)


def test_a_sticky_folder_like_tmp_is_fine_above_a_folder_of_our_own(tmp_path: Path) -> None:
    """In a sticky folder (as /tmp: 1777) only an entry's owner may rename or remove it (and
    a folder below that another user owns is refused in its own right)."""
    so, shared = library_under(tmp_path)
    shared.chmod(0o1777)
    assert nrt.check_trusted_library(str(so)) == str(so)


@as_root
def test_a_folder_above_the_library_that_another_user_owns_is_refused(tmp_path: Path) -> None:
    """Its owner can make it writable whenever they like, whatever its mode now; also below a
    sticky folder, where its owner may rename it."""
    so, shared = library_under(tmp_path)
    tmp_path.chmod(0o1777)
    os.chown(shared, 4242, -1)
    with pytest.raises(OSError, match=rf"folder {shared} is owned by uid 4242 with mode 755"):
        nrt.check_trusted_library(str(so))
    tmp_path.chmod(0o700)
