"""MinMaxUInt8 keeps finite values finite through a real 2-rank ByteGrad job (issue 37.6): before,
a constant chunk of 1e30 (the scale's max * scale overflowed) or a chunk spanning -3e38..3e38
(max - min overflowed) came back as NaN. The expected values come from the numpy reference
(tests/reference_algorithms.py), written from the rule in docs/algorithms.md."""

from __future__ import annotations

import sys

from mp_runner import REPO, launch, needs_core, run_command

WORKER = REPO / "tests" / "workers" / "bytegrad_large_values.py"


@needs_core
def test_bytegrad_keeps_large_finite_values_finite() -> None:
    out = run_command(
        launch(2) + [sys.executable, str(WORKER)], "ByteGrad on large values", timeout=180
    )
    for r in range(2):
        assert f"rank {r}: large values ok" in out, out
