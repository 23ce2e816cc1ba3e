"""The source tree's layering checks (tools/check_layers.py, issue 38): each passes on the
repository and fails on a small tree that breaks it, so a check that can no longer fail is
noticed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tools" / "check_layers.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_layers = _load()


def _write(root: Path, files: dict) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_script_passes_on_the_repository() -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


# ---- native/src include layers ------------------------------------------------------------


def test_native_includes_have_no_back_edge() -> None:
    assert check_layers.check_native_includes() == []


def test_native_include_check_fails_on_a_back_edge(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/common.h": "#pragma once\n",
            "ops/op.h": '#include "base/common.h"\n#include "core/runtime.h"\n',
            "core/runtime.h": '#include "ops/op.h"\n#include "base/common.h"\n',
            "core/runtime.cc": '#include "core/runtime.h"\n',
            "loose.h": '#include "base/common.h"\n',
            "ops/missing.cc": '#include "ops/nowhere.h"\n',
        },
    )
    problems = check_layers.check_native_includes(
        tmp_path, ("base", "ops", "core"), include_dirs=()
    )
    assert problems == [
        "loose.h: not in a layer folder (base, ops, core)",
        'ops/missing.cc: #include "ops/nowhere.h" names no file',
        'ops/op.h: #include "core/runtime.h": ops/ includes core/, above it',
    ]


def test_native_layer_order_is_the_one_design_core_states() -> None:
    """docs/design-core.md's "Layers" names the folders in the script's order, bottom first."""
    text = (REPO / "docs" / "design-core.md").read_text()
    m = re.search(r"^Layer order of `native/src/`[^:\n]*:(.*)$", text, re.M)
    assert m, "docs/design-core.md: no 'Layer order of `native/src/`' line"
    stated = tuple(re.findall(r"`(\w+)/`", m.group(1)))
    assert stated == check_layers.NATIVE_LAYERS


def test_design_core_names_every_native_file() -> None:
    """The concept table of docs/design-core.md names every file of `native/src/` (issue 38)."""
    text = (REPO / "docs" / "design-core.md").read_text()
    table = text.split("## Where each concept lives", 1)[1].split("\n## ", 1)[0]
    named = set()
    for span in re.findall(r"`([\w./{},-]+)`", table):
        m = re.search(r"\{([^{}]*)\}", span)
        alts = m.group(1).split(",") if m else [""]
        for alt in alts:
            named.add(span[: m.start()] + alt + span[m.end() :] if m else span)
    src = REPO / "native" / "src"
    files = {str(p.relative_to(src)) for p in src.rglob("*") if p.is_file()}
    assert sorted(files - named) == []


# ---- bagua_hvd's import graph -------------------------------------------------------------


def test_python_imports_have_no_cycle_and_common_no_runner() -> None:
    problems = check_layers.check_python_imports()
    assert problems == [], "\n".join(problems)


def test_python_import_check_fails_on_a_cycle(tmp_path: Path) -> None:
    """A lazy relative import closing a cycle, and a common module importing the launcher;
    a package importing its own child is no cycle."""
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": "def f():\n    from . import b\n",
            "pkg/b.py": "import pkg.a.missing\n",
            "pkg/common/__init__.py": "",
            "pkg/common/x.py": "from pkg.runner import launch\n",
            "pkg/runner/__init__.py": "",
            "pkg/runner/launch.py": "import os\n",
        },
    )
    problems = check_layers.check_python_imports(tmp_path, "pkg")
    assert problems == [
        "import cycle among 2 modules: pkg.a, pkg.b\n"
        "    pkg.a imports pkg.b (pkg/a.py:2)\n"
        "    pkg.b imports pkg.a (pkg/b.py:1)",
        "pkg.common.x imports pkg.runner.launch (pkg/common/x.py:1): pkg.common is imported by "
        "the workers, which never import the launcher",
    ]
