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
        "the test names every op and skips the handle-counter check",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Records each phase's report on the item, so fixtures can tell whether the test passed."""
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _check_handle_counters(hvd) -> None:
    """Unnamed ops are named "<op>.noname.<handle>" from a per-process counter (as in Horovod):
    after a test, every rank must have enqueued the same number of ops, or the next unnamed op
    would wait forever for a partner. Fail here, naming the cause, instead."""
    import torch

    h = hvd.allreduce_async(torch.zeros(1), name="conftest.counter")
    hvd.synchronize(h)
    ids = hvd.allgather(torch.tensor([h]), name="conftest.counter.ids").tolist()
    assert len(set(ids)) == 1, (
        f"handle counters diverged across ranks {ids}: the test enqueued different numbers of "
        "ops on different ranks, so later unnamed ops would not match"
    )


@pytest.fixture(autouse=True)
def watchdog_and_sync(request):
    """Kills this rank if a test hangs; re-initializes if a test left bagua_hvd shut down;
    checks that a passing test left the ranks' handle counters aligned."""
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
            _check_handle_counters(hvd)
    finally:
        faulthandler.cancel_dump_traceback_later()
