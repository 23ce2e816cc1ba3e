"""Checks that bagua_hvd's source tree stays layered (issue 38): one function per check, each
returning its violations; ``python tools/check_layers.py`` runs them all and exits 1 with the
list when any fails.

- ``check_native_includes``: ``native/src/`` is a stack of folders, ``NATIVE_LAYERS`` from the
  bottom; a file may include its own folder and the folders below it, never one above it
  (docs/design-core.md, "Layers", states the same order).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent

# native/src's folders, bottom first. Written once here; docs/design-core.md repeats it and
# tests/test_layers.py checks that the two agree.
NATIVE_LAYERS = (
    "base",
    "transport",
    "compression",
    "collectives",
    "requests",
    "engines",
    "ops",
    "core",
)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
_NATIVE_SUFFIXES = {".h", ".cc", ".cu"}


def check_native_includes(
    src: Path = REPO / "native" / "src",
    layers: Sequence[str] = NATIVE_LAYERS,
    include_dirs: Sequence[Path] = (REPO / "native" / "include",),
) -> List[str]:
    """Every ``#include "..."`` under ``src``, resolved as the compiler does (the includer's
    folder, then ``src``, then ``include_dirs``), named by file; a violation is a file outside
    the layer folders or an include of a folder above the includer's (or of nothing)."""
    src = src.resolve()
    rank: Dict[str, int] = {name: i for i, name in enumerate(layers)}
    problems: List[str] = []
    for path in sorted(p for p in src.rglob("*") if p.suffix in _NATIVE_SUFFIXES):
        rel = path.relative_to(src)
        folder = rel.parts[0] if len(rel.parts) > 1 else None
        if folder not in rank:
            problems.append(f"{rel}: not in a layer folder ({', '.join(layers)})")
            continue
        for m in _INCLUDE_RE.finditer(path.read_text(errors="replace")):
            name = m.group(1)
            target = _resolve(name, path.parent, src, include_dirs)
            if target is None:
                problems.append(f'{rel}: #include "{name}" names no file')
                continue
            try:
                target_rel = target.relative_to(src)
            except ValueError:
                continue  # the public header (native/include): below every layer
            to = target_rel.parts[0] if len(target_rel.parts) > 1 else None
            if to not in rank:
                problems.append(f'{rel}: #include "{name}" is outside the layer folders')
            elif rank[to] > rank[folder]:
                problems.append(f'{rel}: #include "{name}": {folder}/ includes {to}/, above it')
    return problems


def _resolve(name: str, here: Path, src: Path, include_dirs: Sequence[Path]) -> Optional[Path]:
    for root in (here, src, *include_dirs):
        candidate = root / name
        if candidate.is_file():
            return candidate.resolve()
    return None


CHECKS: Dict[str, Callable[[], List[str]]] = {
    "native/src include layers": check_native_includes,
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    failed = False
    for title, check in CHECKS.items():
        problems = check()
        if problems:
            failed = True
            print(f"{title}: {len(problems)} violation(s)")
            for p in problems:
                print(f"  {p}")
        else:
            print(f"{title}: ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
