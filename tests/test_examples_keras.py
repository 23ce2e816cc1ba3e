"""The Keras digits example (examples/keras/keras_digits.py) trains end to end at 2 ranks
through the launcher, with hvd.DistributedOptimizer and the Horovod callbacks, and reaches at
least 95% accuracy on the held-out digits; rank 0 alone writes the best model."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mp_runner import REPO, needs_core, run_command

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
pytest.importorskip("sklearn", reason="the digits example needs scikit-learn")
pytestmark = needs_core

EXAMPLE = REPO / "examples" / "keras" / "keras_digits.py"


def test_keras_digits_2_ranks(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "bagua_hvd.runner.launch", "-np", "2",
        sys.executable, str(EXAMPLE), "--checkpoint-dir", str(tmp_path),
    ]  # fmt: skip
    text = run_command(cmd, "keras_digits.py at 2 ranks")
    found = re.findall(r"final test accuracy: (\d+\.\d+)", text)
    assert len(found) == 1, f"expected one accuracy line (rank 0 only):\n{text}"
    assert float(found[0]) >= 0.95, text
    assert "finished gradual learning rate warmup" in text, text
    assert (tmp_path / "best.keras").exists(), "rank 0 kept no best model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.keras"], "only rank 0 writes"
