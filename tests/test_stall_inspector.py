"""Horovod's stall inspector at 2 ranks over the real launcher and core: rank 1 does not submit
the tensor rank 0 waits on. Rank 0's log names the missing rank and tensor after
HOROVOD_STALL_CHECK_TIME_SECONDS; after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (marked "!") the job
shuts down and every rank's operations raise Horovod's shut-down error, bounded in time. The
messages are Horovod's (horovod/common/stall_inspector.cc); the coordinator's C++ tests check
them whole."""

from __future__ import annotations

import sys

import pytest
from mp_runner import launch, needs_core, run_command

pytest.importorskip("torch")
pytestmark = needs_core

WORKER = """
import sys, time, torch
import bagua_hvd.torch as hvd

hvd.init()
late = float(sys.argv[1])  # when rank 1 submits the tensor rank 0 waits on
start = time.monotonic()
try:
    if hvd.rank() == 1:
        time.sleep(late)
    out = hvd.allreduce(torch.ones(2), name="stalled", op=hvd.Sum)
    print("DONE", out.tolist(), flush=True)
except hvd.HorovodInternalError as e:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {e}", flush=True)
try:
    hvd.allreduce(torch.ones(1), name="next")
    print("NEXT DONE", flush=True)
except hvd.HorovodInternalError as e:
    print(f"NEXT RAISED: {e}", flush=True)
"""
SHUT_DOWN = "Horovod has been shut down. This was caused by an exception on one of the ranks"


def job(late_s: float, **env: str) -> str:
    cmd = launch(2) + [sys.executable, "-c", WORKER, str(late_s)]
    return run_command(cmd, "the stall job", **env)


def test_a_stall_is_reported_and_the_job_goes_on():
    out = job(3.5, HOROVOD_STALL_CHECK_TIME_SECONDS="1")
    assert "Missing ranks:" in out, out
    assert "[0]<stderr>:1: [allreduce.stalled]" in out, out
    assert "Will shutdown" not in out, out
    for r in range(2):
        assert f"[{r}]<stdout>:DONE [2.0, 2.0]" in out, out
        assert f"[{r}]<stdout>:NEXT DONE" in out, out


def test_past_the_shutdown_time_every_rank_stops():
    out = job(10, HOROVOD_STALL_CHECK_TIME_SECONDS="1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2")
    assert "[0]<stderr>:1!: [allreduce.stalled]" in out, out
    assert (
        'One or more rank (marked by "!") is stalled for longer than 2 seconds. Will shutdown.'
        in (out)
    )
    raised = [line for line in out.splitlines() if line.startswith("[0]<stdout>:RAISED after")]
    assert len(raised) == 1 and SHUT_DOWN in raised[0], out
    assert float(raised[0].split("after ")[1].split(" s")[0]) < 9, out  # not rank 1's 10 s
    assert "[1]<stdout>:RAISED after 10" in out, out  # its late submission fails at once
    for r in range(2):
        assert f"[{r}]<stdout>:NEXT RAISED: {SHUT_DOWN}" in out, out


def test_disabled_it_reports_nothing():
    out = job(
        5,
        HOROVOD_STALL_CHECK_TIME_SECONDS="1",
        HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="2",
        HOROVOD_STALL_CHECK_DISABLE="1",
    )
    assert "Missing ranks:" not in out, out
    for r in range(2):
        assert f"[{r}]<stdout>:DONE [2.0, 2.0]" in out, out
