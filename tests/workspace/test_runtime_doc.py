"""docs/runtime.md names what the code has: every `PoolMetrics` field of its table (and no
other), every per-replica field, the `Result` fields, and the constructor and `map()` keywords
its API example uses."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "runtime.md"


def metrics_table(text: str) -> tuple[set[str], set[str]]:
    """(pool fields, per-replica fields) of the "## Metrics" table."""
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `")]
    pool, replica = set(), set()
    for row in rows:
        name, meaning = row.split("|")[1:3]
        if "replicas[i]" in name:  # the row's `i` is the `index` field
            replica |= set(re.findall(r"`(\w+)`", meaning)) | {"index"}
        else:
            pool |= set(re.findall(r"`(\w+)`", name))
    return pool | {"replicas"}, replica


def metrics_problems(text: str) -> list[str]:
    from polyaccel.core import ReplicaPool
    from polyaccel.core.runtime.toy import ToyReplica

    with ReplicaPool(ToyReplica, num_replicas=1) as pool:
        real = pool.metrics().as_dict()
    pool_doc, replica_doc = metrics_table(text)
    pool_real, replica_real = set(real), set(real["replicas"][0])
    return ([f"documented, not a field: {n}" for n in sorted((pool_doc - pool_real) | (replica_doc - replica_real))]
            + [f"a field the table lacks: {n}" for n in sorted((pool_real - pool_doc) | (replica_real - replica_doc))])


def test_metrics_table_is_the_fields():
    assert metrics_problems(DOC.read_text()) == []


def test_metrics_check_catches_a_stale_row():
    """Negative control: a renamed field and a dropped one are both found."""
    text = DOC.read_text()
    assert metrics_problems(text.replace("| `steals` |", "| `stolen` |"))
    assert metrics_problems(re.sub(r"^\| `restarts` \|.*\n", "", text, flags=re.M))


def test_result_fields_and_api_keywords_exist():
    from polyaccel.core import ReplicaPool
    from polyaccel.core.runtime import Result

    text = DOC.read_text()
    named = set(re.findall(r"`(\w+)`", text.split("`Result` fields:", 1)[1].split("\n\n", 1)[0]))
    assert named - {"unwrap"} <= {f.name for f in dataclasses.fields(Result)} | {"ok"}
    assert hasattr(Result, "ok") and hasattr(Result, "unwrap")
    example = text.split("```python", 1)[1].split("```", 1)[0]
    call = example.split("ReplicaPool(", 1)[1].split(") as pool", 1)[0]
    assert set(re.findall(r"(\w+)=", call)) <= set(inspect.signature(ReplicaPool.__init__).parameters)
    assert "window" in inspect.signature(ReplicaPool.map).parameters
