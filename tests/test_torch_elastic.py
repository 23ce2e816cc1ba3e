"""Runs the torch elastic tests (tests/mp/test_torch_elastic.py: TorchState, ElasticSampler,
hvd.elastic.run, in a job that is not elastic) at size 1 (directly) and through the launcher at
2 and 3 ranks, and asserts that every rank passed. Several sizes, because what the sampler
gives each rank and what commit() broadcasts from rank 0 depend on the size."""

from __future__ import annotations

import pytest
from mp_runner import needs_core, run_inner

pytest.importorskip("torch")
pytestmark = needs_core


@pytest.mark.parametrize("np", [1, 2, 3])
def test_torch_elastic_multiprocess(np: int) -> None:
    run_inner("test_torch_elastic.py", np)
