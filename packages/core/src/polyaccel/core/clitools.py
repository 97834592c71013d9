"""What the ``polyaccel``, ``polyaccel-moe`` and ``polyaccel-asr`` command lines share: strict
JSON output and a quiet exit when the reader of their output goes away (``... | head``)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

#: The exit status after the reader of stdout left: 128 + SIGPIPE, what a shell reports for a
#: standard tool stopped the same way (``yes | head -1``).
EXIT_BROKEN_PIPE = 141


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
