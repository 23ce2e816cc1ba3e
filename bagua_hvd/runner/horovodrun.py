"""``horovodrun`` for bagua_hvd, only where asked for.

``pip install bagua_hvd`` installs ``bagua-run`` and no ``horovodrun``: a console script of that
name would overwrite a real Horovod's (or be overwritten by it) without a word. Instead,

    python -m bagua_hvd.runner.horovodrun install     # [--dir DIR]

writes a ``horovodrun`` script beside this environment's ``bagua-run`` (or into DIR) that runs
``bagua-run --as-horovod``: existing ``horovodrun -np 4 python train.py`` command lines then run
unmodified Horovod scripts on bagua_hvd. It refuses when a ``horovodrun`` is there already and
is not one it wrote (a real Horovod's is never replaced). ``uninstall`` removes the script it
wrote, and nothing else; ``pip uninstall bagua_hvd`` does not know the script, so run
``uninstall`` first.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence

SCRIPT_NAME = "horovodrun"
# The script's second line: what tells a script this module wrote from any other horovodrun.
MARKER = "# bagua_hvd's horovodrun (python -m bagua_hvd.runner.horovodrun install)"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """What the installed ``horovodrun`` runs: ``bagua-run --as-horovod ARGV`` (default
    ``sys.argv[1:]``); returns the exit status."""
    from bagua_hvd.runner.bagua_run import main as bagua_run

    args = list(sys.argv[1:] if argv is None else argv)
    return bagua_run(["--as-horovod", *args])


def script_text(python: str = sys.executable) -> str:
    """The ``horovodrun`` script: ``python`` runs :func:`main`."""
    return (
        f"#!{python}\n"
        f"{MARKER}\n"
        "import sys\n\n"
        "from bagua_hvd.runner.horovodrun import main\n\n"
        "sys.exit(main())\n"
    )


def default_dir() -> Path:
    """Where this environment's console scripts are: the folder holding ``bagua-run`` among the
    interpreter's script folders (the environment's, then the user's), else the first."""
    folders: List[Path] = [Path(sysconfig.get_path("scripts"))]
    user = f"{os.name}_user"
    if user in sysconfig.get_scheme_names():
        folders.append(Path(sysconfig.get_path("scripts", user)))
    for folder in folders:
        if (folder / "bagua-run").exists():
            return folder
    return folders[0]


def is_ours(path: Path) -> bool:
    """Whether ``path`` is a ``horovodrun`` that :func:`install` wrote."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = [f.readline() for _ in range(2)]
    except OSError:
        return False
    return head[1].rstrip("\n") == MARKER


def install(folder: Optional[Path] = None) -> Path:
    """Writes ``horovodrun`` into ``folder`` (default :func:`default_dir`) and returns its path.
    FileExistsError when a ``horovodrun`` is there that this module did not write (one it
    wrote is rewritten: this interpreter's path may have changed)."""
    path = Path(folder or default_dir()) / SCRIPT_NAME
    if (path.exists() or path.is_symlink()) and not is_ours(path):
        raise FileExistsError(
            f"{path} exists and is not bagua_hvd's (a real Horovod's?): left as it is. Use "
            "bagua-run --as-horovod, or remove it first"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SCRIPT_NAME}.{os.getpid()}")
    tmp.write_text(script_text())
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def uninstall(folder: Optional[Path] = None) -> Optional[Path]:
    """Removes the ``horovodrun`` of :func:`install` from ``folder`` (default
    :func:`default_dir`) and returns its path; None when there is none. FileExistsError for a
    ``horovodrun`` this module did not write (left in place)."""
    path = Path(folder or default_dir()) / SCRIPT_NAME
    if not (path.exists() or path.is_symlink()):
        return None
    if not is_ours(path):
        raise FileExistsError(f"{path} is not bagua_hvd's horovodrun: left as it is")
    path.unlink()
    return path


def manage(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m bagua_hvd.runner.horovodrun install|uninstall [--dir DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m bagua_hvd.runner.horovodrun",
        description="Install or remove a 'horovodrun' command that runs bagua-run --as-horovod "
        "(never replacing a horovodrun that bagua_hvd did not write).",
    )
    parser.add_argument("action", choices=("install", "uninstall"))
    parser.add_argument(
        "--dir", type=Path, help=f"where the script goes (default: {default_dir()})"
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "install":
            path = install(args.dir)
            print(f"installed {path}: horovodrun runs bagua-run --as-horovod")
        else:
            path = uninstall(args.dir)
            print(f"removed {path}" if path else "no horovodrun of bagua_hvd's to remove")
    except (FileExistsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(manage())
