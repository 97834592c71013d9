"""Ray clusters that let nobody in: token authentication on, and (for clusters we start on
this machine) every Ray server bound to the loopback interface.

- Token: Ray 2.60's token auth (``RAY_AUTH_MODE=token``) with the token in a 0600 file,
  ``$XDG_CONFIG_HOME/polyaccel/ray_auth_token`` (``~/.config/...``), made on first use and
  passed to Ray through ``RAY_AUTH_TOKEN_PATH``. ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``
  set by the user win.
- Loopback: Ray resolves a node IP of 127.0.0.1 to the machine's external address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; with it the node's IP is 127.0.0.1 and GCS, raylet,
  workers and agents listen on 127.0.0.1 only (single-machine clusters, as on macOS).

``python -m polyaccel.core.ray_local env`` prints the shell exports for ``ray start``.
Ray is imported lazily.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
RAY_INSTALL_HINT = "pip install 'ray[default]' (or the package's [ray] extra)"


def default_token_path() -> Path:
    """``$XDG_CONFIG_HOME/polyaccel/ray_auth_token`` (``~/.config`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "polyaccel" / "ray_auth_token"


def ensure_token(path: Path | None = None) -> Path:
    """Make ``path`` hold a random token, readable by its owner only; return it.

    The token is written to a private temporary file and linked into place, so ``path`` never
    holds a partial token; an empty one (left by an older version killed mid-write; Ray
    refuses it) is replaced."""
    path = Path(path or default_token_path())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _make_private(path.parent, 0o700)  # nobody else may swap the file for one whose token they know
    if path.exists() and path.stat().st_size:
        _make_private(path, 0o600)
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces a token another process made meanwhile
        except FileExistsError:
            if not path.stat().st_size:
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _make_private(path: Path, mode: int) -> None:
    """Take every access of group and others off ``path`` (to ``mode``); refuse one that another
    user owns (they know the token it holds, or can swap the file in the folder)."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user (uid {st.st_uid}): it cannot hold your Ray token; "
                              "set XDG_CONFIG_HOME or RAY_AUTH_TOKEN_PATH to a place of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        path.chmod(mode)


def auth_env(env: MutableMapping[str, str] | None = None, *, force: bool = True) -> dict[str, str]:
    """The variables that turn token auth on with our token file.

    :param force: also replace a ``RAY_AUTH_MODE`` the user set (clusters we start);
        without it an explicit mode is kept (joining someone else's cluster).
    """
    env = os.environ if env is None else env
    out: dict[str, str] = {}
    mode = env.get("RAY_AUTH_MODE")
    if mode is None or (force and mode.lower() != "token"):
        if mode is not None:
            log.warning("RAY_AUTH_MODE=%s ignored: clusters started here keep token authentication on", mode)
        out["RAY_AUTH_MODE"] = "token"
    if not env.get("RAY_AUTH_TOKEN") and not env.get("RAY_AUTH_TOKEN_PATH"):
        out["RAY_AUTH_TOKEN_PATH"] = str(ensure_token())
    return out


def local_cluster_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Everything a cluster started on this machine needs: token auth and loopback only."""
    return {**auth_env(env), **LOOPBACK_ENV}


def _apply(values: dict[str, str]) -> None:
    os.environ.update(values)
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in values and "ray._private.ray_constants" in sys.modules:
        # Ray reads the flag once, at import; a process that imported Ray already needs it set too.
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:  # Ray caches the auth mode and the token
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def import_ray(hint: str = RAY_INSTALL_HINT) -> Any:
    """``import ray`` with a message naming what to install."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(f"this needs Ray: {hint} ({e})") from None
    return ray


def private_temp_dir() -> str:
    """A path for one cluster's temp dir (sessions, logs, sockets) inside a new folder that only
    this user can enter; Ray makes it.

    Ray makes its temp dir (``/tmp/ray`` by default, or the one given) and every folder in it
    world-writable (0777, no sticky bit): any local user could read the logs or swap a socket,
    unless a folder above lets nobody else in. Short (Ray's socket paths must fit 107 bytes);
    honours ``RAY_TMPDIR``."""
    return os.path.join(tempfile.mkdtemp(prefix="ray-", dir=os.environ.get("RAY_TMPDIR") or "/tmp"), "t")


_owned_temp_dirs: list[str] = []  # the private folders of the clusters init_local started in this process
EXIT_WAIT_S = 30.0
"""How long a process that started a private cluster may take to exit once it begins to
(Ray's shutdown included) before the cluster's processes are killed, its folders removed and
the process ended with status 1."""
_exit_hooked = False


def _processes_naming(folder: str) -> list[int]:
    """PIDs (other than this process) whose command line names ``folder``: the processes of a
    cluster whose temp dir is inside it. Linux (/proc); elsewhere none are found."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(entry.name) != os.getpid() and folder.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (OSError, ValueError):
            pass
    return pids


def _give_up(folders: list[str]) -> None:
    """The exit did not finish in time: kill the clusters' processes (on Linux Ray also ends
    them with their driver), remove their folders, end this process with status 1."""
    log.warning("exit did not finish in %.0f s: killing the private Ray cluster's processes", EXIT_WAIT_S)
    for folder in folders:
        for pid in _processes_naming(folder):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


def _stop_and_remove_owned_temp_dirs() -> None:
    """At exit: stop the cluster (``ray.shutdown()``, as Ray's own exit hook would, later),
    then remove the private folders (sessions, logs, spilled objects, sockets) of every
    cluster :func:`init_local` started in this process.

    Runs first at exit: from threading's exit hook, before the interpreter waits for
    non-daemon threads (so that none of Ray's can hold the exit), and again from ``atexit``. A
    watchdog bounds the rest of the exit to :data:`EXIT_WAIT_S` (:func:`_give_up`), so that a
    hung ``ray.shutdown()`` still ends the process and leaves nothing running."""
    if not _owned_temp_dirs:
        return
    import threading

    watchdog = threading.Timer(EXIT_WAIT_S, _give_up, args=(list(_owned_temp_dirs),))
    watchdog.daemon = True
    watchdog.start()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    while _owned_temp_dirs:
        shutil.rmtree(_owned_temp_dirs.pop(), ignore_errors=True)


def _hook_exit() -> None:
    """Register :func:`_stop_and_remove_owned_temp_dirs` with threading's exit hooks (run
    before non-daemon threads are joined; private API, used where it exists) and ``atexit``
    (after Ray's own hook, registered at import, so it runs first)."""
    global _exit_hooked
    if not _exit_hooked:
        import threading

        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            register(_stop_and_remove_owned_temp_dirs)
        _exit_hooked = True
    atexit.unregister(_stop_and_remove_owned_temp_dirs)
    atexit.register(_stop_and_remove_owned_temp_dirs)


def init_local(num_cpus: int | None = None, **kwargs: Any) -> Any:
    """Start a private in-process Ray cluster on loopback with token auth, its files in a
    :func:`private_temp_dir`; return ``ray``. That folder is removed at exit (after the
    cluster is stopped)."""
    _apply(local_cluster_env())
    ray = import_ray()
    if "_temp_dir" not in kwargs:
        _hook_exit()  # at exit: stop, then remove; never hangs (_stop_and_remove_owned_temp_dirs)
        kwargs["_temp_dir"] = private_temp_dir()
        _owned_temp_dirs.append(os.path.dirname(kwargs["_temp_dir"]))
    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("logging_level", "WARNING")
    ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **kwargs)
    return ray


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``host:port``, ``ray://...``, ``http://...``) names this machine's loopback."""
    host = (address or "").rpartition("://")[2].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def starts_private_cluster(address: str | None) -> bool:
    """Whether a job given ``address`` should start its own cluster (:func:`init_local`) rather
    than :func:`connect`: no address and no ``RAY_ADDRESS`` (which ``ray job submit`` sets), or
    ``"local"``. Never one that happens to be running on this machine already."""
    target = address or os.environ.get("RAY_ADDRESS")
    return not target or target == "local"


def check_address(address: str | None) -> str:
    """The cluster address a job given ``address`` joins (``RAY_ADDRESS`` where ``address`` is
    None or ``"auto"``, Ray's precedence); raise ValueError for none or ``"auto"``, which
    :func:`connect` refuses. Callers check before any work starts."""
    env_address = os.environ.get("RAY_ADDRESS")
    target = env_address if env_address and address in (None, "auto") else address
    if target in (None, "", "auto"):
        raise ValueError("give the Ray cluster's address (host:port, or RAY_ADDRESS; 'local' for a private "
                         "cluster): 'auto' would join whatever cluster another local user advertises")
    return target


def connect(address: str | None = None, **kwargs: Any) -> Any:
    """Join an existing cluster (``address``, or ``RAY_ADDRESS``) with our token; return ``ray``.
    A cluster on loopback is joined from loopback (Ray would otherwise look for this node
    under the machine's external address). ``"local"`` (the address, or ``RAY_ADDRESS``
    when no other address is given) starts a private cluster through :func:`init_local`:
    Ray's own would listen on every interface, and keep a ``RAY_AUTH_MODE`` the user set.
    No address (or ``"auto"``) is refused, never guessed: Ray's ``"auto"`` takes the address
    in ``/tmp/ray/ray_current_cluster`` (a folder any local user can write) or of any
    ``gcs_server`` process here, whoever runs it; joining another user's cluster hands them
    our token and lets their workers send this driver pickles."""
    target = check_address(address)
    if target == "local":
        return init_local(**kwargs)
    env = auth_env(force=False)
    if is_loopback_address(target):
        env.update(LOOPBACK_ENV)
    _apply(env)
    ray = import_ray()
    ray.init(address=target, **kwargs)
    return ray


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


HEAD_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
                   "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
                   "--node-manager-port", "--object-manager-port")


@dataclass
class Head:
    """A running ``ray start --head --block``: its process, addresses and client environment."""

    proc: subprocess.Popen
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]


def _wait_for_dashboard(head: subprocess.Popen, url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return
        except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
            return
        except OSError:
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray start failed or timed out:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


@contextmanager
def start_head(num_cpus: int = 2, *, env: dict[str, str] | None = None, timeout: float = 120,
               extra_args: tuple[str, ...] = ()) -> Iterator[Head]:
    """Run ``ray start --head --block`` on loopback with token auth, every port free (so it
    never meets another cluster on this machine) and a private temp dir; stop it on exit.
    Killing the ``--block`` process stops this cluster only (never ``ray stop``)."""
    env = {**(os.environ if env is None else env), "RAY_USAGE_STATS_ENABLED": "0"}
    env.update(local_cluster_env(env))
    env.update(AUTOSCALER_METRIC_PORT=str(free_port()), DASHBOARD_METRIC_PORT=str(free_port()))
    ports = {flag: free_port() for flag in HEAD_PORT_FLAGS}
    temp = private_temp_dir()
    os.mkdir(temp)
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--node-ip-address={LOOPBACK}",
           f"--dashboard-host={LOOPBACK}", f"--temp-dir={temp}", "--disable-usage-stats",
           *[f"{flag}={port}" for flag, port in ports.items()], *extra_args]
    log = Path(temp, "head.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://{LOOPBACK}:{ports['--dashboard-port']}"
    try:
        _wait_for_dashboard(proc, url, timeout, log)
        yield Head(proc, f"{LOOPBACK}:{ports['--port']}", url, env)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(os.path.dirname(temp), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``env``: print ``export`` lines for ``ray start``/``ray job submit`` on this machine."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["env"]:
        print("usage: python -m polyaccel.core.ray_local env", file=sys.stderr)
        return 2
    for k, v in local_cluster_env().items():
        print(f"export {k}={shlex.quote(v)}")  # for eval: a path may hold spaces or $
    return 0


if __name__ == "__main__":
    sys.exit(main())
