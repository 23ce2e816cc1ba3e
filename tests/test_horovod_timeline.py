"""Horovod's timeline (HOROVOD_TIMELINE, hvd.start_timeline/stop_timeline; requests/timeline.h) at 2
ranks through the real launcher: rank 0's Chrome-trace JSON parses, B/E events are well nested
on every row, each tensor's row shows Horovod's phases in order (NEGOTIATE_<TYPE> with one mark
per rank, then <TYPE> with QUEUE, MEMCPY_IN_FUSION_BUFFER, the collective and
MEMCPY_OUT_FUSION_BUFFER for fused allreduces), the dynamic start/stop records only what ran
between, cycle markers appear only with mark_cycles, and the errors are Horovod's."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from mp_runner import launch, run_command

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "horovod_timeline_worker.py"

pytest.importorskip("torch")


def run_job(*args: str, **env: str) -> str:
    """The worker at 2 ranks with env; its output (stdout and stderr)."""
    return run_command(launch(2) + [sys.executable, str(WORKER), *args], "the worker", **env)


def load_rows(path: Path) -> tuple[list, dict]:
    """The events (the file must be one JSON array) and, per tensor name, its row's events,
    checked well nested: every E closes an open B, nothing stays open, time never goes back."""
    events = json.loads(path.read_text())
    assert isinstance(events, list)
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e["args"]
    }
    assert len(set(names.values())) == len(names), "one row per tensor"
    rows: dict = defaultdict(list)
    for e in events:
        if e["ph"] in ("B", "E", "X"):
            rows[names[e["pid"]]].append(e)
    for name, row in rows.items():
        stack: list = []
        last_ts = 0
        for e in row:
            assert e["ts"] >= last_ts, (name, row)
            last_ts = e["ts"]
            if e["ph"] == "B":
                stack.append(e["name"])
            elif e["ph"] == "E":
                assert stack, f"{name}: E without B: {row}"
                stack.pop()
            else:
                assert stack and stack[-1].startswith("NEGOTIATE_"), (name, row)
        assert not stack, f"{name}: left open: {stack}"
    return events, rows


def phases(row: list) -> list:
    """The row as (depth, name) of its B events and 'rank:<r>' of its X marks."""
    out, depth = [], 0
    for e in row:
        if e["ph"] == "B":
            out.append((depth, e["name"]))
            depth += 1
        elif e["ph"] == "E":
            depth -= 1
        else:
            out.append((depth, "rank:" + e["name"]))
    return out


def test_timeline_from_environment(tmp_path):
    path = tmp_path / "timeline.json"
    out = run_job("env", HOROVOD_TIMELINE=str(path), HOROVOD_TIMELINE_MARK_CYCLES="1")
    # Read while the job ran (as Horovod's test_timeline does): valid JSON with the first op.
    assert "[0]<stdout>:LIVE True True" in out, out
    text = path.read_text()
    for needle in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "CYCLE_START"):
        assert needle in text  # Horovod's test_timeline.py assertions
    events, rows = load_rows(path)
    assert events[0]["name"] == "process_name" and events[0]["pid"] == 0
    assert "start_time_since_epoch_in_micros" in events[0]["args"]
    negotiate = [(0, "NEGOTIATE_ALLREDUCE"), (1, "rank:0"), (1, "rank:1")]
    # Unfused: no fusion buffer.
    p = phases(rows["allreduce.test_allreduce"])
    assert p[0] == negotiate[0] and sorted(p[1:3]) == negotiate[1:]
    assert p[3:] == [(0, "ALLREDUCE"), (1, "QUEUE"), (1, "GLOO_ALLREDUCE")]
    # Fused: a grouped allreduce (both tensors ready in the same cycle on every rank) always;
    # asynchronous ones waited for together, when they became ready within one cycle.
    fused_phases = [
        (0, "ALLREDUCE"),
        (1, "QUEUE"),
        (1, "MEMCPY_IN_FUSION_BUFFER"),
        (1, "GLOO_ALLREDUCE"),
        (1, "MEMCPY_OUT_FUSION_BUFFER"),
    ]
    for name in ("grouped_allreduce.grouped_0", "grouped_allreduce.grouped_1"):
        p = phases(rows[name])
        assert p[0] == negotiate[0] and sorted(p[1:3]) == negotiate[1:], p
        assert p[3:] == fused_phases, (name, p)
    for name in [f"allreduce.fused.{i}" for i in range(4)]:
        p = phases(rows[name])
        assert p[3:] in (fused_phases, [(0, "ALLREDUCE"), (1, "QUEUE"), (1, "GLOO_ALLREDUCE")])
    # The tensors of one fused response share its activities' timestamps.
    g0, g1 = rows["grouped_allreduce.grouped_0"], rows["grouped_allreduce.grouped_1"]
    assert [e["ts"] for e in g0[4:]] == [e["ts"] for e in g1[4:]]
    # Horovod's request and response type of an Adasum is ADASUM.
    p = phases(rows["allreduce.test_adasum"])
    assert p[0] == (0, "NEGOTIATE_ADASUM") and p[3:5] == [(0, "ADASUM"), (1, "QUEUE")], p
    for kind, collective in (("ALLGATHER", "GLOO_ALLGATHER"), ("BROADCAST", "GLOO_BCAST")):
        p = phases(rows[f"{kind.lower()}.test_{kind.lower()}"])
        assert p[0] == (0, f"NEGOTIATE_{kind}")
        assert p[3:] == [(0, kind), (1, "QUEUE"), (1, collective)], p
    # The DistributedOptimizer's step: its parameters' broadcasts and its gradient bucket.
    assert {"broadcast.weight", "broadcast.bias"} <= set(rows)
    step = [n for n in rows if n.startswith("allreduce.") and "bias" in n and "+" in n]
    assert step, sorted(rows)
    assert (0, "ALLREDUCE") in phases(rows[step[0]])
    # Each op's top-level end carries the dtype, as Horovod's, and the bytes rank 0 sent for it
    # (2 ranks on one host: all within it).
    ends = [e for e in rows["allreduce.test_allreduce"] if e["ph"] == "E"]
    args = ends[-1]["args"]
    assert set(args) == {"dtype", "within_host_bytes_sent", "between_hosts_bytes_sent"}, args
    assert args["dtype"] == "float32" and args["between_hosts_bytes_sent"] == 0, args
    assert 0 < args["within_host_bytes_sent"] <= 2 * 3 * 4, args  # at most twice the 3 floats
    assert sum(1 for e in events if e.get("name") == "CYCLE_START") >= 5


def test_dynamic_start_stop(tmp_path):
    path = tmp_path / "dynamic.json"
    run_job("dynamic", str(path), HOROVOD_TIMELINE="DYNAMIC")
    events, rows = load_rows(path)
    # Rank 1 may submit after_stop before rank 0 stops: its negotiation may have begun then
    # (closed at the stop), never its execution.
    assert {"allreduce.between", "allgather.between_gather"} <= set(rows)
    assert set(rows) <= {"allreduce.between", "allgather.between_gather", "allreduce.after_stop"}
    if "allreduce.after_stop" in rows:
        assert all(
            n.startswith(("NEGOTIATE_", "rank:")) for _, n in phases(rows["allreduce.after_stop"])
        )
    assert phases(rows["allgather.between_gather"])[3:] == [
        (0, "ALLGATHER"),
        (1, "QUEUE"),
        (1, "GLOO_ALLGATHER"),
    ]
    assert not any(e.get("name") == "CYCLE_START" for e in events)  # mark_cycles=False
    events2, rows2 = load_rows(Path(str(path) + ".2"))
    assert set(rows2) == {"allreduce.second_file"}
    assert any(e.get("name") == "CYCLE_START" for e in events2)


def test_errors_without_horovod_timeline():
    out = run_job("errors")
    assert out.count("BEFORE_INIT Horovod has not been initialized; use hvd.init().") == 2, out
    not_enabled = "NOT_ENABLED Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."
    assert out.count(not_enabled) == 2, out
    assert out.count("STOPPED") == 2, out


def test_unwritable_file_is_logged_and_the_job_runs(tmp_path):
    path = tmp_path / "missing-dir" / "timeline.json"
    out = run_job("plain", HOROVOD_TIMELINE=str(path))
    assert "Error opening the Horovod Timeline file" in out, out
    assert not path.exists()
