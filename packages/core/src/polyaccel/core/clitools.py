"""What the ``polyaccel``, ``polyaccel-moe`` and ``polyaccel-asr`` command lines share: strict
JSON output, a quiet exit when the reader of their output goes away (``... | head``), an
error for a broken pipe that is not stdout, SIGTERM ended like Ctrl-C, and a second Ctrl-C
that ends the process at once; text from files made safe for one terminal line (`printable`)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

#: The exit status after the reader of stdout left: 128 + SIGPIPE, what a shell reports for a
#: standard tool stopped the same way (``yes | head -1``).
EXIT_BROKEN_PIPE = 141
#: The exit status of an error no other status names (Python's own for an uncaught exception).
EXIT_ERROR = 1
#: The exit statuses after SIGHUP, Ctrl-C and SIGTERM (128 + the signal), as a shell reports them.
EXIT_HUNG_UP = 129
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``timeout``, a job scheduler's pre-emption) or SIGHUP (the terminal
    closed), raised where Ctrl-C's ``KeyboardInterrupt`` would be, so the same cleanup runs
    (see :func:`sigterm_as_interrupt`); ``signum`` says which."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__()
        self.signum = signum


_signal_seen: int | None = None  # what arrived inside sigterm_as_interrupt (Ray's get turns Terminated into a plain KeyboardInterrupt)
_SIGHUP = getattr(signal, "SIGHUP", None)  # (none on Windows)


def _terminate(signum: int, frame: Any) -> None:
    global _signal_seen
    _signal_seen = signum
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises :class:`Terminated`, a
    ``KeyboardInterrupt``: whatever a command does on Ctrl-C (close and keep what it wrote,
    release locks, stop private clusters) it does on SIGTERM too, and on SIGHUP (the terminal
    closed) where that would have ended the process (not under ``nohup``, which ignores it).
    Off the main thread: nothing."""
    global _signal_seen
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _signal_seen = None
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _terminate)}
    if _SIGHUP is not None and signal.getsignal(_SIGHUP) is signal.SIG_DFL:
        previous[_SIGHUP] = signal.signal(_SIGHUP, _terminate)
    try:
        yield
    finally:  # (None: a handler set outside Python)
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


_STOPPING = b"\nstopping: finishing the work in flight and saving it (Ctrl-C again to stop at once)\n"
"""Said at a terminal on the first Ctrl-C: the wait that follows (a batch running on a CPU
takes seconds) is the command at work, not a hang."""


def _interrupt_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
    with contextlib.suppress(OSError):
        if os.isatty(2):
            os.write(2, _STOPPING)
    raise KeyboardInterrupt


@contextlib.contextmanager
def second_ctrl_c_ends_at_once() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` once; a second one, while the command unwinds (waiting
    for work in flight, removing a half-written checkpoint) or the interpreter exits, ends the
    process at once, as a second SIGTERM does. Raised again inside that unwinding it left worker
    threads running in torch at exit: "terminate called without an active exception", SIGABRT
    and a core dump (polyaccel-asr), or a traceback. Only where Python's own handler is set (not
    where Ctrl-C is ignored), in the main thread."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    signal.signal(signal.SIGINT, _interrupt_once)
    try:
        yield
    finally:  # after a Ctrl-C it stays at the default: the exit that follows is not interrupted
        if signal.getsignal(signal.SIGINT) is _interrupt_once:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupt_status(e: KeyboardInterrupt) -> tuple[int, str]:
    """(exit status, word) for a command ended by ``e``: 143 "terminated" for SIGTERM, 129
    "hung up" for SIGHUP, 130 "interrupted" for Ctrl-C. A plain ``KeyboardInterrupt`` after
    either signal (Ray's ``get`` raises one for whatever its signal handler raised) is the
    signal's."""
    signum = e.signum if isinstance(e, Terminated) else _signal_seen
    if signum is None:
        return EXIT_INTERRUPTED, "interrupted"
    return (EXIT_HUNG_UP, "hung up") if signum == _SIGHUP else (EXIT_TERMINATED, "terminated")


def printable(text: object) -> str:
    """``text`` (a path, or a message quoting one) safe on one line of a terminal: undecodable
    bytes as ``\\xNN`` (as in a record's ``path``), control and other unprintable characters
    escaped the way Python writes them (``\\n``, ``\\x1b``, ``\\u202e``). For messages only:
    records keep the exact path."""
    if not isinstance(text, bytes):
        text = str(text)
        try:
            text = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that is no file name's byte: escaped below
            pass
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float replaced by None (JSON ``null``), recursively
    through mappings, lists and tuples (tuples become lists)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that always writes strict JSON: NaN and infinities become ``null``
    (:func:`json_safe`), never the ``NaN``/``Infinity`` tokens other parsers refuse."""
    return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def stdout_gone() -> int:
    """Call on a ``BrokenPipeError`` writing stdout: point stdout at ``/dev/null`` (so the
    interpreter's flush at exit raises nothing either) and return :data:`EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout without a file descriptor (captured)
        pass
    return EXIT_BROKEN_PIPE


def stdout_broken() -> bool:
    """Whether the reader of stdout went away: flushing it fails with a broken pipe, or stdout
    is a pipe whose reading end is closed (``poll``; False where that cannot be told)."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError, AttributeError):
        pass
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll (Windows), stdout without a descriptor
        return False


def broken_pipe(e: BrokenPipeError, prog: str) -> int:
    """Call on a ``BrokenPipeError`` that ended command ``prog``: when stdout's reader went
    away, :func:`stdout_gone` (quiet, 141); else another pipe broke (a log written into a FIFO
    whose reader left...): a one-line error naming it on stderr, and :data:`EXIT_ERROR`."""
    if e.filename is None and stdout_broken():
        return stdout_gone()
    what = e.filename if e.filename is not None else "a pipe other than stdout"
    why = e.strerror or "broken pipe"
    print(f"{prog}: error: cannot write {what}: {why} (its reader went away)", file=sys.stderr)
    return EXIT_ERROR


def exit_process(status: int) -> NoReturn:
    """End a command with exit ``status``. A rank of a multi-process run (``WORLD_SIZE`` > 1,
    torch.distributed imported) runs Python's exit handlers, flushes its streams and ends
    there (``os._exit``), skipping the interpreter's teardown: the C++ destructors of the
    communication threads torch.distributed leaves behind at times abort a process that has
    finished ("terminate called without an active exception", exit -6), which would hide its
    status (0, or the error the run reported). Any other process exits normally."""
    if "torch.distributed" not in sys.modules or _world_size() <= 1:
        sys.exit(status)
    import atexit

    atexit._run_exitfuncs()  # (logging's flush is one of them)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
