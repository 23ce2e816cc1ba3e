"""Fixtures for tests that run inside the launcher (one pytest process per rank).

Every rank runs the same tests in the same order, so collectives line up; a rank that fails
exits (pytest -x), and its peers then fail fast with HorovodInternalError (peer lost) instead of
hanging. A watchdog kills a rank whose test runs longer than BAGUA_HVD_TEST_TIMEOUT seconds.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
for _p in (_TESTS, _TESTS.parent):  # tests/ (reference.py, mp helpers) and the repo root
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# Waits in the core and in Python give up instead of hanging the job.
os.environ.setdefault("BAGUA_HVD_OP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "60")

TEST_TIMEOUT_S = float(os.environ.get("BAGUA_HVD_TEST_TIMEOUT", "300"))
PROBE_TIMEOUT_S = 60.0  # the unnamed-op probe after each test (a slow sanitized peer included)


@pytest.fixture(scope="session", autouse=True)
def hvd_session():
    """Initializes bagua_hvd once per rank for the whole session."""
    import bagua_hvd.torch as hvd

    hvd.init()
    yield hvd
    if hvd.is_initialized():
        hvd.barrier()  # any rank's shutdown stops the whole job: leave together
    hvd.shutdown()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "handles_may_diverge: ranks enqueue different numbers of ops by design (process sets); "
        "the test names every op and skips the unnamed-op probe",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records each phase's report on the item, so fixtures can tell whether the test passed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _check_unnamed_ops_match(hvd) -> None:
    """Unnamed ops are named "<op>.noname.<n>", n counting this process's unnamed ops of that
    kind and process set: after a test, every rank must have enqueued the same number of them,
    or the next unnamed op would wait for a partner that never comes. An unnamed probe that
    does not complete within PROBE_TIMEOUT_S fails here, naming the cause, instead."""
    import time

    import torch

    h = hvd.allgather_async(torch.tensor([hvd.rank()]))
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    while not hvd.poll(h):
        assert time.monotonic() < deadline, (
            "an unnamed allgather did not complete: the test enqueued different numbers of "
            "unnamed allgathers on different ranks, so their names no longer match"
        )
        time.sleep(0.005)
    assert hvd.synchronize(h).tolist() == list(range(hvd.size()))


@pytest.fixture(autouse=True)
def watchdog_and_sync(request):
    """Kills this rank if a test hangs; re-initializes if a test left bagua_hvd shut down;
    checks that a passing test left the ranks' unnamed-op numbering aligned."""
    import bagua_hvd.torch as hvd

    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    try:
        if not hvd.is_initialized():
            hvd.init()
        yield
        if not hvd.is_initialized():
            hvd.init()
        rep = getattr(request.node, "rep_call", None)
        diverging = request.node.get_closest_marker("handles_may_diverge") is not None
        if rep is not None and rep.passed and hvd.size() > 1 and not diverging:
            _check_unnamed_ops_match(hvd)
    finally:
        faulthandler.cancel_dump_traceback_later()
