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


@pytest.fixture(autouse=True)
def watchdog_and_sync(request):
    """Kills this rank if a test hangs; re-initializes if a test left bagua_hvd shut down."""
    import bagua_hvd.torch as hvd

    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    try:
        if not hvd.is_initialized():
            hvd.init()
        yield
        if not hvd.is_initialized():
            hvd.init()
    finally:
        faulthandler.cancel_dump_traceback_later()
