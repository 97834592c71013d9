"""Our ctypes declarations of libnrt against the published headers (not against our fake).

``data/nrt_published.h`` re-types the declarations we use from the Neuron Runtime headers
(upstream file and commit in its comment). gcc compiles a small program that prints each
struct's size and field offsets and each enumerator's value; those are compared with
:mod:`polyaccel.neuron.nrt`'s ``ctypes`` structures, constants and ``_PROTOTYPES``.
Each comparison is also run on a deliberately drifted header to show it catches drift.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from polyaccel.neuron import nrt

HEADER = Path(__file__).parent / "data" / "nrt_published.h"
STRUCTS = {"nrt_tensor_info_t": nrt.TensorInfoC, "nrt_tensor_info_array_t": nrt.TensorInfoArrayC}
ENUMS = ("NRT_STATUS", "nrt_tensor_placement_t", "nrt_framework_type_t", "nrt_dtype_t", "nrt_tensor_usage_t")
OPAQUE = {"void", "nrt_model_t", "nrt_tensor_t", "nrt_tensor_set_t"}
SCALARS = {"size_t": ctypes.c_size_t, "int32_t": ctypes.c_int32, "int": ctypes.c_int, "NRT_STATUS": ctypes.c_int,
           **{e: ctypes.c_int for e in ENUMS}}
NUMPY_NAMES = {"FLOAT32": np.float32, "BFLOAT16": ml_dtypes.bfloat16, "FLOAT16": np.float16, "INT32": np.int32,
               "INT64": np.int64, "INT8": np.int8, "UINT8": np.uint8, "INT16": np.int16, "UINT16": np.uint16,
               "UINT32": np.uint32, "UINT64": np.uint64}


def _enumerators(header: str) -> list[str]:
    """Names declared inside the header's ``enum { ... }`` bodies."""
    names = []
    for body in re.findall(r"enum\s*\w*\s*\{(.*?)\}", header, re.S):
        names += [m.group(1) for m in re.finditer(r"\b(NRT_\w+)\s*(?:=[^,]*)?,?", body)]
    return names


def _fields(header: str, struct: str) -> list[str]:
    """Field names of ``typedef struct ... { ... } struct;``."""
    body = re.search(r"typedef struct \w+ \{([^{}]*)\}\s*" + struct + ";", header).group(1)
    return [re.search(r"(\w+)\s*(\[[^]]*\])?\s*$", decl).group(1) for decl in body.split(";") if decl.strip()]


def _layout_program(header: str) -> str:
    """C source printing ``sizeof``/``offsetof`` of our structs and every enumerator's value."""
    lines = [f'printf("sizeof {t} %zu\\n", sizeof({t}));' for t in (*STRUCTS, *ENUMS)]
    for struct in STRUCTS:
        for f in _fields(header, struct):
            lines.append(f'printf("offset {struct}.{f} %zu\\n", offsetof({struct}, {f}));')
    lines += [f'printf("enum {e} %d\\n", (int){e});' for e in _enumerators(header)]
    body = "\n    ".join(lines)
    return f'#include <stddef.h>\n#include <stdio.h>\n#include "header.h"\nint main(void) {{\n    {body}\n    return 0;\n}}\n'


def _c_facts(header: str, tmp: Path) -> dict[str, int]:
    """Compile and run the layout program against ``header``; ``{"sizeof X": n, ...}``."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler (gcc) to measure the published layouts")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "header.h").write_text(header)
    (tmp / "layout.c").write_text(_layout_program(header))
    subprocess.run([gcc, "-std=c11", "-Wall", "-Werror", "-o", str(tmp / "layout"), str(tmp / "layout.c")],
                   check=True, cwd=tmp)
    out = subprocess.run([str(tmp / "layout")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.rsplit(" ", 1) for line in out.splitlines())}


def layout_mismatches(facts: dict[str, int]) -> list[str]:
    """Where our ctypes structs and constants differ from the compiled header's facts."""
    bad = []
    for struct, cls in STRUCTS.items():
        c_fields = {k.split(".", 1)[1]: v for k, v in facts.items() if k.startswith(f"offset {struct}.")}
        ours = {name: getattr(cls, name).offset for name, _ in cls._fields_}
        if struct == "nrt_tensor_info_array_t":  # the flexible array member starts after our header struct
            ours["tensor_array"] = ctypes.sizeof(cls)
        else:
            ours["sizeof"], c_fields["sizeof"] = ctypes.sizeof(cls), facts[f"sizeof {struct}"]
        if ours != c_fields:
            bad.append(f"{struct}: ours {ours} != published {c_fields}")
    bad += [f"sizeof {e} is {facts[f'sizeof {e}']}, we pass c_int" for e in ENUMS
            if facts[f"sizeof {e}"] != ctypes.sizeof(ctypes.c_int)]
    expected = {"NRT_FRAMEWORK_TYPE_NO_FW": nrt.FRAMEWORK_NONE, "NRT_TENSOR_PLACEMENT_DEVICE": nrt.PLACEMENT_DEVICE,
                "NRT_TENSOR_USAGE_INPUT": nrt.USAGE_INPUT, "NRT_TENSOR_USAGE_OUTPUT": nrt.USAGE_OUTPUT}
    expected |= {f"NRT_DTYPE_{n}": nrt.DTYPE_CODES[np.dtype(t)] for n, t in NUMPY_NAMES.items()}
    expected |= {name: code for code, name in nrt.STATUS_NAMES.items() if f"enum {name}" in facts}
    expected |= {name: code for code, name in nrt.UNSUPPORTED_DTYPE_NAMES.items()}
    bad += [f"{name} = {facts.get(f'enum {name}')} published, {v} ours" for name, v in expected.items()
            if facts.get(f"enum {name}") != v]
    if len(nrt.DTYPE_CODES) != len(NUMPY_NAMES):
        bad.append("DTYPE_CODES has dtypes this check does not name")
    return bad


def _ctype(decl: str):
    """The ctypes type for a C type with its name removed (``const char *``, ``NRT_STATUS``...)."""
    decl = decl.replace("const ", "").strip()
    stars = decl.count("*")
    base = decl.replace("*", " ").split()
    base = base[0] if base else "void"
    if stars == 0:
        return None if base == "void" else SCALARS[base]
    if base == "char" and stars == 1:
        return ctypes.c_char_p
    if base in OPAQUE:
        return ctypes.c_void_p if stars == 1 else ctypes.POINTER(ctypes.c_void_p)
    if base == "nrt_tensor_info_array_t":
        t = nrt.TensorInfoArrayC
        for _ in range(stars):
            t = ctypes.POINTER(t)
        return t
    raise ValueError(f"no ctypes mapping for {decl!r}")


def published_prototypes(header: str) -> dict[str, tuple]:
    """``{name: (restype, [argtypes])}`` parsed from the header's one-line prototypes."""
    protos = {}
    for ret, name, args in re.findall(r"^(\w+)\s+(nrt_\w+)\((.*)\);$", header, re.M):
        params = [] if args.strip() in ("", "void") else args.split(",")
        protos[name] = (_ctype(ret), [_ctype(re.sub(r"\w+\s*$", "", p)) for p in params])
    return protos


def prototype_mismatches(published: dict[str, tuple], ours: dict[str, tuple]) -> list[str]:
    """Functions whose return or argument types differ, or that only one side declares."""
    bad = [f"{n}: only in {'ours' if n in ours else 'the header'}" for n in sorted(set(published) ^ set(ours))]
    for n in sorted(set(published) & set(ours)):
        if published[n][0] != ours[n][0] or list(published[n][1]) != list(ours[n][1]):
            bad.append(f"{n}: published {published[n]} != ours {ours[n]}")
    return bad


# ---- tests ---------------------------------------------------------------------------------------


def test_struct_layouts_and_codes_match_the_published_header(tmp_path):
    facts = _c_facts(HEADER.read_text(), tmp_path / "real")
    assert facts["sizeof nrt_tensor_info_t"] == ctypes.sizeof(nrt.TensorInfoC)  # the check ran on real numbers
    assert layout_mismatches(facts) == []


def test_layout_check_catches_drift(tmp_path):
    """Negative control: a header whose ``size`` field is 32-bit, whose float32 code moved and
    whose status enum grew by one name ours maps elsewhere fails the check."""
    drifted = (HEADER.read_text().replace("    size_t size;", "    uint32_t size;")
               .replace("NRT_DTYPE_FLOAT32 = 0xA", "NRT_DTYPE_FLOAT32 = 0x1A")
               .replace("NRT_CLOSED = 14", "NRT_CLOSED = 15"))
    bad = layout_mismatches(_c_facts(drifted, tmp_path / "drifted"))
    assert any(b.startswith("nrt_tensor_info_t") for b in bad), bad
    assert any(b.startswith("NRT_DTYPE_FLOAT32") for b in bad), bad
    assert any(b.startswith("NRT_CLOSED") for b in bad), bad


def test_prototypes_match_the_published_header():
    published = published_prototypes(HEADER.read_text())
    assert len(published) == 14  # every one-line prototype in the file was parsed
    assert prototype_mismatches(published, nrt._PROTOTYPES) == []


def test_prototype_check_catches_drift():
    """Negative control: a missing argument, a narrowed size and an extra function are reported."""
    published = published_prototypes(HEADER.read_text())
    ours = dict(nrt._PROTOTYPES)
    ours["nrt_load"] = (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p)])
    ours["nrt_tensor_write"] = (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_size_t])
    ours["nrt_made_up"] = (ctypes.c_int, [])
    bad = prototype_mismatches(published, ours)
    assert [b.split(":")[0] for b in bad] == ["nrt_made_up", "nrt_load", "nrt_tensor_write"], bad
