"""The first Ctrl-C at a terminal says that the command is stopping and how to stop it at
once: the wait for the work in flight that follows (a speech batch on a CPU, seconds) looked
like a hang. Where stderr is no terminal (a log, a pipe, a test) nothing is added."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from polyaccel.core.clitools import second_ctrl_c_ends_at_once
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a shell's prompt (a job started
    try:                                                     # in the background has SIGINT ignored)
        with second_ctrl_c_ends_at_once():
            os.kill(os.getpid(), signal.SIGINT)
            signal.pause()
    except KeyboardInterrupt:
        print("unwound", file=sys.stderr, flush=True)
""")


def _stderr_of(tty: bool) -> str:
    if not tty:
        return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60).stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave)
    os.close(slave)
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the other end is closed and all was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_the_first_ctrl_c_at_a_terminal_says_the_command_is_stopping():
    err = _stderr_of(tty=True)
    assert "stopping: finishing the work in flight and saving it (Ctrl-C again to stop at once)\nunwound" in err


def test_without_a_terminal_nothing_is_added():
    assert _stderr_of(tty=False) == "unwound\n"
