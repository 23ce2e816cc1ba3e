"""Horovod's build facts in ``horovod.common.util`` (``mpi_built``, ``gloo_built``,
``nccl_built``, ``ddl_built``, ``ccl_built``, ``cuda_built``, ``rocm_built``, and ``_cache``),
imported from ``bagua_hvd.common.util`` as Horovod's own tests and launch scripts do
(test/parallel/test_common.py: ``from horovod.common.util import _cache, gloo_built,
mpi_built``). Each runs in a fresh process: NCCL is loaded once per process."""

from __future__ import annotations

import json
import sys

from mp_runner import needs_core, run_command
from test_cuda_support import _built_with_cuda, _wheel_version_code

pytestmark = needs_core

FACTS = """
import json, sys
from bagua_hvd.common.util import (
    ccl_built, cuda_built, ddl_built, gloo_built, mpi_built, nccl_built, rocm_built,
)
names = ["mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
         "rocm_built"]
util = {n: globals()[n]() for n in names}
assert all(globals()[n](verbose=True) == util[n] for n in names)
frontend = sys.argv[1]
if frontend == "torch":
    import bagua_hvd.torch as hvd
else:
    import bagua_hvd.tensorflow as hvd
print("FACTS " + json.dumps({"util": util, "frontend": {n: getattr(hvd, n)() for n in names}}))
"""


def _facts(frontend: str) -> dict:
    text = run_command([sys.executable, "-c", FACTS, frontend], "build facts")
    line = next(ln for ln in text.splitlines() if ln.startswith("FACTS "))
    return json.loads(line[len("FACTS ") :])


def test_build_facts_are_this_builds() -> None:
    facts = _facts("torch")
    util = facts["util"]
    # Horovod's test_common.py: under a Gloo launcher gloo_built() holds, else mpi_built().
    assert util["gloo_built"] is True and util["mpi_built"] is True
    assert util["ddl_built"] is False and util["ccl_built"] is False
    assert util["rocm_built"] is False
    expected_cuda = _built_with_cuda()
    if expected_cuda is not None:  # the CMake tree that built the library under test
        assert util["cuda_built"] is expected_cuda
    assert isinstance(util["nccl_built"], int) and not isinstance(util["nccl_built"], bool)
    # NCCL serves CUDA tensors only in a CUDA build; it is then the [test] extra's wheel.
    assert util["nccl_built"] == (_wheel_version_code() if util["cuda_built"] else 0)
    # The same answers as the frontend's hvd.*_built().
    assert util == facts["frontend"]


def test_build_facts_match_tensorflow_frontend() -> None:
    facts = _facts("tensorflow")
    assert facts["util"] == facts["frontend"]


def test_cache_computes_once() -> None:
    """Horovod's test_common.py::test_cache."""
    from bagua_hvd.common.util import _cache

    state = {"key": 1}

    @_cache
    def fn():
        return state["key"]

    assert fn() == 1
    state["key"] = 2
    assert fn() == 1
