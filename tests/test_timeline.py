"""bench/_timeline.py (bench/algorithms.py --timeline): the per-step timeline of one rank is
complete and in causal order, at 2 ranks over the real launcher and core: for every bucket its
launch, the core's begin and end of its collective (ByteGrad: its alltoall half between), the
return of its wait and, where the update runs bucket by bucket, its update after that."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mp_runner import launch, run_command

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "timeline_worker.py"

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def timeline() -> dict:
    text = run_command(launch(2) + [sys.executable, str(WORKER)], "the timeline worker")
    line = next(x for x in text.splitlines() if "TIMELINE " in x)
    return json.loads(line.split("TIMELINE ", 1)[1])


def _first(events, what, bucket):
    times = [t for t, w, b, _n in events if w == what and b == bucket]
    assert times, f"no {what!r} for bucket {bucket!r}"
    return times[0]


def _check_common(steps, n_buckets, what_launch="launch"):
    for st in steps:
        ev = st["events"]
        assert [e[0] for e in ev] == sorted(e[0] for e in ev)
        # Only the core's events of the previous step's collectives may come before the start.
        t0 = next(t for t, w, _b, _n in ev if w == "step begins")
        assert t0 == st["t0"] and ev[-1][1] == "step ends"
        assert all(w.startswith("core ") for t, w, _b, _n in ev if t < t0)
        launches = [e for e in ev if e[1] == what_launch]
        assert [e[2] for e in launches] == [str(b) for b in range(n_buckets)]


def test_core_trace_is_available(timeline):
    assert timeline["has_core"]


def test_bytegrad_bucket_by_bucket(timeline):
    data = timeline["bytegrad"]
    n = data["buckets"]
    assert n == 3
    _check_common(data["steps"], n)
    for st in data["steps"]:
        ev = st["events"]
        updates = [t for t, w, _b, _n in ev if w == "update begins"]
        assert len(updates) == n  # the update runs bucket by bucket
        for b in map(str, range(n)):
            t = [
                _first(ev, "launch", b),
                _first(ev, "core bytegrad begin", b),
                _first(ev, "core bytegrad alltoall done", b),
                _first(ev, "core bytegrad end", b),
                _first(ev, "wait returns", b),
            ]
            assert t == sorted(t), (b, t)
            assert any(u >= t[-1] for u in updates)
        # Each bucket's update follows its own wait, before the next bucket's wait returns.
        waits = [_first(ev, "wait returns", str(b)) for b in range(n)]
        for k in range(n - 1):
            assert waits[k] <= updates[k] <= waits[k + 1]


def test_low_precision_exchange_overlaps_the_next_step(timeline):
    data = timeline["low_precision_decentralized"]
    n = data["buckets"]
    _check_common(data["steps"], n, "exchange launch")
    last = data["steps"][-1]["events"]
    for b in map(str, range(n)):
        # This step: the previous step's exchange is waited for, then the local half runs,
        # then the new exchange starts.
        wait = _first(last, "wait returns", b + " (prev. step)")
        local = _first(last, "core lp local begin", b)
        launch = _first(last, "exchange launch", b)
        assert wait <= local <= launch
        # The previous step's exchange ran in the core (begun after its launch), ending before
        # its wait returned; its end shows in whichever step it happened.
        prev = data["steps"][-2]["events"]
        labels = (b, b + " (prev. step)")
        begins = [
            t for t, w, lab, _n in prev + last if w == "core lp exchange begin" and lab in labels
        ]
        ends = [t for t, w, lab, _n in prev + last if w == "core lp exchange end" and lab in labels]
        assert begins and ends
        assert _first(prev, "exchange launch", b) <= begins[0] <= ends[0] <= wait
    # Bucket 0's exchange is launched before the last bucket's local half begins.
    assert _first(last, "exchange launch", "0") < _first(last, "core lp local begin", str(n - 1))


def test_allreduce_waits_follow_the_core(timeline):
    data = timeline["gradient_allreduce"]
    n = data["buckets"]
    _check_common(data["steps"], n)
    for st in data["steps"]:
        ev = st["events"]
        for b in map(str, range(n)):
            t = [
                _first(ev, "launch", b),
                _first(ev, "core allreduce begin", b),
                _first(ev, "core allreduce end", b),
                _first(ev, "wait returns", b),
            ]
            assert t == sorted(t), (b, t)
