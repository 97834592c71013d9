"""Fixtures shared by the test packages."""

import importlib.util
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture
def ctrl_c_while_torch_loads():
    """``run(launcher, argv, cwd)``: a fresh Python that imports ``launcher`` (``"module:function"``),
    sets ``sys.argv = argv`` and calls it, with a Ctrl-C raised where torch is first imported;
    the finished ``subprocess.CompletedProcess``."""

    def run(launcher: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
        module, function = launcher.split(":")
        script = textwrap.dedent(f"""
            import sys

            class CtrlC:
                def find_spec(self, name, path=None, target=None):
                    if name == "torch":
                        raise KeyboardInterrupt

            sys.meta_path.insert(0, CtrlC())
            from {module} import {function}
            sys.argv = {argv!r}
            {function}()
        """)
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd, timeout=120)

    return run


@pytest.fixture
def free_port():
    """A callable returning a free TCP port on the loopback interface (tests never leave it)."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for in-process models: on a shared 2-core machine the small decode
    ops lose more to thread hand-offs than they gain (4-5x slower with 2 threads under load).
    Restored when the module's tests are done."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def load_tool():
    """``load_tool("device_pack")``: ``tools/device_pack.py`` as a module. tools/ is not a
    package: loaded by path, registered in ``sys.modules`` first (dataclasses look it up)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"polyaccel_tools_{name}", TOOLS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
