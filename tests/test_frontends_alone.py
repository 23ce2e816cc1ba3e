"""Each frontend works where the other framework is absent, and the launcher and the common
package import neither framework. (Both frameworks installed together is what every other test
runs with: the test command installs torch and tensorflow-cpu in one environment.)"""

from __future__ import annotations

import sys

import pytest
from mp_runner import needs_core, run_command

pytestmark = needs_core


@pytest.mark.parametrize("frontend", ["torch", "tensorflow"])
def test_frontend_without_the_other_framework(frontend: str) -> None:
    pytest.importorskip(frontend)
    np = 2
    launch = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np)]
    cmd = launch + [sys.executable, "tests/workers/frontend_alone.py", frontend]
    text = run_command(cmd, f"{frontend} frontend at {np} ranks")
    absent = "tensorflow" if frontend == "torch" else "torch"
    for r in range(np):
        assert f"rank {r}: {frontend} frontend OK without {absent}" in text, text


def test_launcher_and_common_import_no_framework() -> None:
    code = (
        "import sys\n"
        "import bagua_hvd, bagua_hvd.common.basics, bagua_hvd.common.ops, bagua_hvd.runner.launch\n"
        "import bagua_hvd.common.algorithms, bagua_hvd.common.engine, bagua_hvd.common.primitives\n"
        "import bagua_hvd.common.compression\n"
        "bad = [m for m in ('torch', 'tensorflow', 'keras') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('no framework imported')\n"
    )
    text = run_command([sys.executable, "-c", code], "importing the framework-free modules")
    assert "no framework imported" in text
