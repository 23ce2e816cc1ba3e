"""Runs tests/mp/test_tf_horovod_names.py (TensorFlowKerasState from the Keras elastic modules,
the TF1 BroadcastGlobalVariablesHook, LocalGradientAggregationHelperEager) at 2 ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

from mp_runner import needs_core, run_inner  # noqa: E402

pytestmark = needs_core


def test_tf_horovod_names_2_ranks() -> None:
    run_inner("test_tf_horovod_names.py", 2)
