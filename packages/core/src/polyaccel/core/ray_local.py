"""Ray clusters that let nobody in: token authentication on, and (for clusters we start on
this machine) every Ray server bound to the loopback interface.

- Token: Ray 2.60's token auth (``RAY_AUTH_MODE=token``) with the token in a 0600 file,
  ``$XDG_CONFIG_HOME/polyaccel/ray_auth_token`` (``~/.config/...``), made on first use and
  passed to Ray through ``RAY_AUTH_TOKEN_PATH``. ``RAY_AUTH_TOKEN`` or ``RAY_AUTH_TOKEN_PATH``
  set by the user win.
- Loopback: Ray resolves a node IP of 127.0.0.1 to the machine's external address unless
  ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``; with it the node's IP is 127.0.0.1 and GCS, raylet,
  workers and agents listen on 127.0.0.1 only (single-machine clusters, as on macOS).
- Ports: every Ray server binds a port of its own choosing (0) where Ray allows it, so no
  other local user can take it first; after start, every port the cluster uses must be held
  by the cluster's own processes (:func:`check_ports_are_ours`, Linux), else it is stopped.
- Metrics: the autoscaler's and the dashboard's Prometheus servers (no authentication) are
  off (:data:`METRICS_OFF_ENV`). The dashboard agent's one cannot be turned off in Ray 2.60.

``python -m polyaccel.core.ray_local env`` prints the shell exports for ``ray start``.
Ray is imported lazily.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
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
import threading
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
METRICS_OFF_ENV = {"AUTOSCALER_METRIC_PORT": "-1", "DASHBOARD_METRIC_PORT": "-1"}
"""Ray 2.60 has no switch for the autoscaler's and the dashboard head's Prometheus servers
(plain HTTP, no token; fixed ports 44217 and 44227 by default). Port -1 makes their bind fail,
which both catch and log ("An exception occurred while starting the metrics server"); the
cluster runs without them. The dashboard agent's metrics export server stays: its port is
Ray's ``--metrics-export-port`` and nothing turns it off (``--disable-metrics-collection`` of
``dashboard/agent.py`` is never passed by Ray's launcher)."""
RAY_INSTALL_HINT = "pip install 'ray[default]' (or the package's [ray] extra)"


def default_token_path() -> Path:
    """``$XDG_CONFIG_HOME/polyaccel/ray_auth_token`` (``~/.config`` without it)."""
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "polyaccel" / "ray_auth_token"


def ensure_token(path: Path | None = None) -> Path:
    """Make ``path`` hold a random token, readable by its owner only; return it.

    The token is written to a private temporary file and linked into place, so ``path`` never
    holds a partial token; an empty one (left by an older version killed mid-write; Ray
    refuses it) is replaced, and so is one that group or others could read or write (they may
    know it, or have written one of theirs there), with a warning."""
    path = Path(path or default_token_path())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    _make_private(path.parent, 0o700)  # nobody else may swap the file for one whose token they know
    if path.exists() and path.stat().st_size:
        if not _make_private(path, 0o600):
            return path
        log.warning("the Ray token file %s could be read or written by others: replaced with a new token (a "
                    "cluster started with the old one must be restarted to be joined)", path)
        _write_token(path, replace=True)
        return path
    _write_token(path, replace=False)
    return path


def _write_token(path: Path, *, replace: bool) -> None:
    """A new random token into ``path`` through a private, synced temporary file: renamed over
    ``path`` (``replace``), else linked in, never over a token another process made meanwhile."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)  # never replaces a token another process made meanwhile
        except FileExistsError:
            if not path.stat().st_size:
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _make_private(path: Path, mode: int) -> bool:
    """Take every access of group and others off ``path`` (to ``mode``); refuse one that another
    user owns (they know the token it holds, or can swap the file in the folder). Returns
    whether group or others had any access."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user (uid {st.st_uid}): it cannot hold your Ray token; "
                              "set XDG_CONFIG_HOME or RAY_AUTH_TOKEN_PATH to a place of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        path.chmod(mode)
        return True
    return False


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
    """Everything a cluster started on this machine needs: token auth, loopback only, and no
    unauthenticated metrics servers that can be turned off."""
    return {**auth_env(env), **LOOPBACK_ENV, **METRICS_OFF_ENV}


def _apply(values: dict[str, str]) -> None:
    os.environ.update(values)
    if "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" in values and "ray._private.ray_constants" in sys.modules:
        # Ray reads the flag once, at import; a process that imported Ray already needs it set too.
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:  # Ray caches the auth mode and the token
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def _keeping_sigterm_handler() -> Iterator[None]:
    """``ray.init`` sets its own SIGTERM handler (``sys.exit``) over the one the application set
    (the CLIs' :func:`polyaccel.core.clitools.sigterm_as_interrupt`, which ends a run as Ctrl-C
    does: its line, status 143, files closed): put the application's back. Ray's stays where
    none was set (it makes a SIGTERM run the exit hooks)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    finally:
        if callable(previous) and signal.getsignal(signal.SIGTERM) is not previous:
            signal.signal(signal.SIGTERM, previous)


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
    with _keeping_sigterm_handler():
        ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **kwargs)
    try:
        check_ports_are_ours(_node_ports(ray), os.getpid())
    except PortTakenError:
        ray.shutdown()
        raise
    return ray


DASHBOARD_AGENT_PORT = 52365
"""The dashboard agent's HTTP port in a cluster ``ray.init`` starts: Ray's fixed default,
which ``ray.init`` has no argument for. Another process on it leaves the agent without its
HTTP server (Ray reports -1 and serves it nowhere); a private cluster never uses that server."""


def _node_ports(ray: Any) -> dict[str, int]:
    """The TCP ports the in-process cluster's node reports it serves (as its clients find them)."""
    node = ray._private.worker._global_node
    ports = {"GCS": int(node.gcs_address.rsplit(":", 1)[1]), "node manager": node.node_manager_port,
             "runtime env agent": node.runtime_env_agent_port, "metrics agent": node.metrics_agent_port,
             "metrics export": node.metrics_export_port, "dashboard agent": node.dashboard_agent_listen_port}
    return {name: port for name, port in ports.items() if port and port > 0}  # -1: not served


def is_loopback_address(address: str | None) -> bool:
    """Whether a Ray address (``host:port``, ``ray://...``, ``http://...``) names this machine's loopback."""
    host = (address or "").rpartition("://")[2].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to be this machine's loopback
        return False


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
    _warn_if_open_job_cluster()  # before auth_env sets this process's mode
    env = auth_env(force=False)
    if is_loopback_address(target):
        env.update(LOOPBACK_ENV)
    _apply(env)
    ray = import_ray()
    with _keeping_sigterm_handler():
        ray.init(address=target, **kwargs)
    return ray


JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray for the driver of a ``ray job submit`` job, which otherwise inherits the head's
environment (``RAY_AUTH_MODE`` included)."""


def _warn_if_open_job_cluster() -> None:
    """A warning when this process is a Ray job's driver whose head runs without token
    authentication (started without ``eval "$(python -m polyaccel.core.ray_local env)"``):
    whoever reaches that cluster's ports can submit jobs to it, that is run code."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if JOB_ENV in os.environ and (mode or "").lower() != "token":
        log.warning("this Ray job's cluster was started without token authentication (RAY_AUTH_MODE=%s in the "
                    "job's environment, which is the head's): anyone who reaches its ports can run code on it. "
                    "Start the head after eval \"$(python -m polyaccel.core.ray_local env)\" (docs/asr.md, Ray)",
                    mode or "unset")


class PortTakenError(RuntimeError):
    """A port the cluster uses is held by a process that is not the cluster's."""


def _listening_sockets() -> dict[int, list[tuple[int, int]]]:
    """port -> (inode, uid) of every TCP socket listening on it (IPv4 and IPv6, any user)."""
    out: dict[int, list[tuple[int, int]]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                f = line.split()
                if f[3] == "0A":  # TCP_LISTEN
                    out.setdefault(int(f[1].rsplit(":", 1)[1], 16), []).append((int(f[9]), int(f[7])))
    return out


def _process_tree(root: int) -> set[int]:
    """``root`` and its descendants (from each process's parent in ``/proc/<pid>/stat``)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def _socket_inodes(pids: set[int]) -> set[int]:
    """The inodes of the sockets ``pids`` hold open (``/proc/<pid>/fd``)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(fd.path)
                    if link.startswith("socket:["):
                        inodes.add(int(link[8:-1]))
    return inodes


def port_owners(ports: dict[str, int], root: int) -> dict[str, str]:
    """For each named port: ``"ours"`` (listened on, by ``root``'s process tree only),
    ``"none"`` (nobody listens) or ``"uid N"`` (a socket of another process, user N, listens)."""
    listening = _listening_sockets()
    mine = _socket_inodes(_process_tree(root))
    owners = {}
    for name, port in ports.items():
        foreign = [uid for inode, uid in listening.get(port, []) if inode not in mine]
        owners[name] = f"uid {foreign[0]}" if foreign else "ours" if port in listening else "none"
    return owners


def _can_check_ports() -> bool:
    if os.path.exists("/proc/net/tcp"):
        return True
    log.warning("cannot check who holds the Ray cluster's ports here (no /proc/net/tcp)")
    return False


def check_ports_are_ours(ports: dict[str, int], root: int) -> None:
    """Raise :class:`PortTakenError` unless every port in ``ports`` (name -> port) is listened
    on by ``root``'s process tree only: another process on one would get the connections (and
    the token) of the cluster's clients. Matches ``/proc/net/tcp{,6}`` with ``/proc/<pid>/fd``."""
    if not _can_check_ports():
        return
    bad = {name: owner for name, owner in port_owners(ports, root).items() if owner != "ours"}
    if bad:
        raise PortTakenError(_port_message(ports, bad))


def _port_message(ports: dict[str, int], bad: dict[str, str]) -> str:
    held = ", ".join(f"{LOOPBACK}:{ports[n]} ({n}) {'has no listener' if o == 'none' else f'is held by {o}'}"
                     for n, o in bad.items())
    return (f"refusing the Ray cluster: {held}; not its own process: its clients would talk to that "
            f"process and send it the cluster's token. The cluster was stopped; start again (new ports) "
            f"or find who holds the port (ss -ltnp)")


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


SELF_BOUND_PORT_FLAGS = ("--port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                         "--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port",
                         "--object-manager-port")
"""Given 0: each server binds a port of its own (no other user can take it first) and Ray
passes it on through port files in the session folder or the GCS."""
PICKED_PORT_FLAGS = ("--dashboard-port", "--ray-client-server-port")
"""Ports we pick (Ray does not learn the dashboard's port back; the client server refuses 0),
then check are the cluster's own before the cluster is used."""


@dataclass
class Head:
    """A running ``ray start --head --block``: its process, addresses and client environment."""

    proc: subprocess.Popen
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]


def _session_ports(temp: str) -> dict[str, int]:
    """The ports Ray's servers chose, from the port files in the session folder (-1: not served)."""
    ports = {}
    for f in Path(temp).glob("session_latest/*_port_*"):
        with contextlib.suppress(OSError, ValueError):
            port = int(f.read_text())
            if port > 0:
                ports[f.name.rsplit("_", 1)[0]] = port
    return ports


def _answers_http(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2)
    except urllib.error.HTTPError:  # 401 without a token: the dashboard is up
        return True
    except OSError:
        return False
    return True


def _wait_until_up(head: subprocess.Popen, picked: dict[str, int], temp: str, timeout: float, log: Path) -> int:
    """Wait until the dashboard answers, the GCS has written its port and every port of the
    cluster is held by its own processes; return the GCS port. Raise :class:`PortTakenError`
    as soon as another process holds one of them, RuntimeError if Ray fails or times out."""
    check = _can_check_ports()
    deadline = time.monotonic() + timeout
    while True:
        ports = {**picked, **_session_ports(temp)}
        owners = port_owners(ports, head.pid) if check else dict.fromkeys(ports, "ours")
        taken = {name: owner for name, owner in owners.items() if owner.startswith("uid")}
        if taken:
            raise PortTakenError(_port_message(ports, taken))
        if ("gcs_server_port" in ports and set(owners.values()) == {"ours"}
                and _answers_http(f"http://{LOOPBACK}:{picked['--dashboard-port']}")):
            return ports["gcs_server_port"]
        if head.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start failed or timed out:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    """Stop ``ray start --block`` (it stops its cluster), then kill whatever of its process
    group is left (a stop before Ray set up its own handlers leaves the servers running)."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextmanager
def start_head(num_cpus: int = 2, *, env: dict[str, str] | None = None, timeout: float = 120,
               extra_args: tuple[str, ...] = ()) -> Iterator[Head]:
    """Run ``ray start --head --block`` on loopback with token auth, its servers on ports of
    their own (never one another cluster or user holds) and a private temp dir; stop it on
    exit. Refuses (:class:`PortTakenError`) a cluster one of whose ports another process holds.
    Killing the ``--block`` process stops this cluster only (never ``ray stop``)."""
    env = {**(os.environ if env is None else env), "RAY_USAGE_STATS_ENABLED": "0"}
    env.update(local_cluster_env(env))
    picked = {flag: free_port() for flag in PICKED_PORT_FLAGS}
    temp = private_temp_dir()
    os.mkdir(temp)
    ray_bin = Path(sys.executable).with_name("ray")
    cmd = [str(ray_bin), "start", "--head", "--block", f"--num-cpus={num_cpus}", f"--node-ip-address={LOOPBACK}",
           f"--dashboard-host={LOOPBACK}", f"--temp-dir={temp}", "--disable-usage-stats",
           *[f"{flag}=0" for flag in SELF_BOUND_PORT_FLAGS],
           *[f"{flag}={port}" for flag, port in picked.items()], *extra_args]
    log = Path(temp, "head.log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        gcs_port = _wait_until_up(proc, picked, temp, timeout, log)
        yield Head(proc, f"{LOOPBACK}:{gcs_port}", f"http://{LOOPBACK}:{picked['--dashboard-port']}", env)
    finally:
        _stop(proc)
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
