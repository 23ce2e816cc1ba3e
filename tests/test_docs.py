"""The README and docs/*.md name only what exists: files their commands run, bagua-run flags,
environment variables, and the Python names they use (issue 37.4). Each check reads the text
the way a user copies from it, and looks the name up in the tree or the installed package,
never in a list kept beside the docs."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
SOURCES = ["bagua_hvd", "native", "tests", "bench", "examples", ".ci", "docker", "setup.py"]

# Paths as commands and links use them: relative to the repository root.
PATH_RE = re.compile(
    r"(?<![\w./-])((?:bagua_hvd|bench|docs|docker|examples|native|tests|\.ci)/[\w./{},-]*[\w/}])"
)
# Code spans and fenced blocks: where commands, flags, variables and names are written.
SPAN_RE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z]{1,3})(?=[\s=`'\"]|$)")
VAR_RE = re.compile(r"\b((?:HOROVOD|BAGUA_HVD)_[A-Z0-9_]*[A-Z0-9])\b")
HVD_RE = re.compile(r"\bhvd\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")
MODULE_RE = re.compile(r"\bbagua_hvd(?:\.[A-Za-z_][A-Za-z0-9_]*)+")

FRONTENDS = [
    "bagua_hvd.torch",
    "bagua_hvd.tensorflow",
    "bagua_hvd.tensorflow.keras",
    "bagua_hvd.keras",
]


def _spans(doc: Path) -> Iterator[Tuple[int, str]]:
    """(line number, text) of every code span and fenced block of ``doc``."""
    text = doc.read_text()
    for m in SPAN_RE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(0).strip("`")


def _where(doc: Path, line: int) -> str:
    return f"{doc.relative_to(REPO)}:{line}"


def _source_text() -> str:
    parts = []
    for name in SOURCES:
        root = REPO / name
        files = [root] if root.is_file() else root.rglob("*")
        for f in files:
            if (
                f.is_file()
                and f.suffix in {".py", ".cc", ".h", ".cu", ".sh", ".txt", ""}
                and ("__pycache__" not in f.parts)
            ):
                try:
                    parts.append(f.read_text(errors="replace"))
                except OSError:
                    continue
    return "\n".join(parts)


def _expand(path: str) -> List[str]:
    """``a.{h,cc}`` -> ``a.h``, ``a.cc``; ``x/{a,b}.cc`` alike (one brace group)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [path[: m.start()] + alt + path[m.end() :] for alt in m.group(1).split(",")]


# Inside native/src/, docs name files relative to it ("core/runtime.cc").
NATIVE_SRC = REPO / "native" / "src"
_NATIVE_DIRS = "|".join(p.name for p in NATIVE_SRC.iterdir() if p.is_dir())
NATIVE_REL_RE = re.compile(r"`((?:" + _NATIVE_DIRS + r")/[\w./{},-]*[\w}])`")


def test_every_path_a_doc_names_exists() -> None:
    missing: List[str] = []
    for doc in DOCS:
        text = doc.read_text()
        found = [(m.start(), m.group(1), REPO) for m in PATH_RE.finditer(text)]
        found += [(m.start(), m.group(1), NATIVE_SRC) for m in NATIVE_REL_RE.finditer(text)]
        for start, path, root in found:
            path = path.split("::")[0].rstrip(".")
            if PATH_RE.match(path) and root is NATIVE_SRC:
                continue  # a repository path inside backquotes: checked from the root
            if any(c in path for c in "*<>"):
                continue  # a pattern, not a file
            for one in _expand(path):
                if not (root / one).exists():
                    line = text.count("\n", 0, start) + 1
                    missing.append(f"{_where(doc, line)}: {one}")
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


def test_every_test_a_doc_names_exists() -> None:
    """``tests/x.py::test_name`` references name a test defined in that file."""
    missing: List[str] = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"(tests/[\w/]+\.py)::(\w+)", text):
            f = REPO / m.group(1)
            if f.exists() and not re.search(rf"def {m.group(2)}\b", f.read_text()):
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{_where(doc, line)}: {m.group(1)}::{m.group(2)}")
    assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)


def _launcher_options() -> set:
    from bagua_hvd.runner.flags import make_parser

    return {s for a in make_parser()._actions for s in a.option_strings}


def test_every_bagua_run_flag_a_doc_names_exists() -> None:
    known = _launcher_options()
    unknown: List[str] = []
    for doc in DOCS:
        for line, span in _spans(doc):
            for cmd in re.split(r"\n|&&|;|\|", span):
                words = cmd.split()
                for launcher in ("bagua-run", "horovodrun"):
                    if launcher not in words:
                        continue
                    args = words[words.index(launcher) + 1 :]
                    # Flags up to the command the launcher starts (python, bash, ...).
                    for i, w in enumerate(args):
                        if not w.startswith("-"):
                            prev = args[i - 1] if i else ""
                            if prev.startswith("-") and "=" not in prev:
                                continue  # the previous flag's value
                            if w in ("python", "python3", "bash", "sh") or w.endswith(".py"):
                                break
                            continue
                        flag = w.split("=")[0].rstrip("`'\",.:)")
                        if re.fullmatch(r"-{1,2}[A-Za-z][\w-]*", flag) and flag not in known:
                            unknown.append(f"{_where(doc, line)}: {launcher} {flag}")
    assert not unknown, "docs use launcher flags that bagua-run does not have:\n" + "\n".join(
        unknown
    )


ENVIRONMENT_DOC = REPO / "docs" / "environment.md"


def _aliases(var: str) -> List[str]:
    """Every ``HOROVOD_X`` may also be spelled ``BAGUA_HVD_X`` (README), and the reverse."""
    for a, b in (("HOROVOD_", "BAGUA_HVD_"), ("BAGUA_HVD_", "HOROVOD_")):
        if var.startswith(a):
            return [var, b + var[len(a) :]]
    return [var]


def test_every_environment_variable_a_doc_names_is_read() -> None:
    """Read by the code (under either spelling), or a Horovod variable that docs/environment.md
    lists with what bagua_hvd does about it."""
    source = _source_text()
    listed = ENVIRONMENT_DOC.read_text() if ENVIRONMENT_DOC.exists() else ""
    unread: List[str] = []
    for doc in DOCS:
        text = doc.read_text()
        for m in VAR_RE.finditer(text):
            var = m.group(1)
            if var in ("HOROVOD_X", "BAGUA_HVD_X"):
                continue  # the README's placeholder for the spelling rule
            names = _aliases(var)
            listed_here = var.startswith("HOROVOD_") and re.search(rf"^\|\s*`{var}`", listed, re.M)
            if not any(n in source for n in names) and not listed_here:
                line = text.count("\n", 0, m.start()) + 1
                unread.append(f"{_where(doc, line)}: {var}")
    assert not unread, "docs name environment variables no code reads:\n" + "\n".join(
        sorted(set(unread))
    )


def _optional_missing(e: ImportError) -> bool:
    """The import failed because a package outside bagua_hvd is not installed here (an optional
    dependency: bagua_hvd.lightning without Lightning): its names cannot be checked here."""
    return isinstance(e, ModuleNotFoundError) and not (e.name or "bagua_hvd").startswith(
        "bagua_hvd"
    )


def _resolves(dotted: str) -> bool:
    """Whether ``a.b.c`` is a module, or an attribute path inside one (True, unchecked, where
    an optional dependency it needs is not installed)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError as e:
            if _optional_missing(e):
                return True
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        except ImportError as e:  # a lazy attribute (bagua_hvd.lightning.HorovodStrategy)
            if _optional_missing(e):
                return True
            raise
        return True
    return False


@pytest.fixture(scope="module")
def frontends() -> list:
    out = []
    for name in FRONTENDS:
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            pass  # tensorflow or keras missing: those names are then checked by module path
    return out


def test_every_python_name_a_doc_uses_exists(frontends) -> None:
    missing: List[str] = []
    for doc in DOCS:
        for line, span in _spans(doc):
            for m in MODULE_RE.finditer(span):
                name = m.group(0)
                if not _resolves(name):
                    missing.append(f"{_where(doc, line)}: {name}")
            for m in HVD_RE.finditer(span):
                path = m.group(1).split(".")
                found = False
                for fe in frontends:
                    obj = fe
                    try:
                        for attr in path:
                            obj = getattr(obj, attr)
                        found = True
                        break
                    except AttributeError:
                        continue
                if not found:
                    missing.append(f"{_where(doc, line)}: hvd.{m.group(1)}")
    assert not missing, "docs use Python names that do not exist:\n" + "\n".join(
        sorted(set(missing))
    )
