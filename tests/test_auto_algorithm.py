"""algorithm="auto": the multi-process tests of tests/mp/test_torch_auto.py and
tests/mp/test_tf_auto.py at 2 and 3 ranks, and ``bagua-run --algorithm auto``."""

from __future__ import annotations

import pytest
from mp_runner import needs_core, run_inner

pytestmark = needs_core


@pytest.mark.parametrize("np", [2, 3])
def test_torch_auto(np: int) -> None:
    pytest.importorskip("torch")
    run_inner("test_torch_auto.py", np)
