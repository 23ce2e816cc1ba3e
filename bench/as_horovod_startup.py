"""What the start-up hook of ``BAGUA_HVD_AS_HOROVOD`` (bagua_hvd_as_horovod.pth, installed into
site-packages by ``pip install``) costs every Python process of the environment.

    python bench/as_horovod_startup.py               # 2000 hook runs, 100 starts per case
    python bench/as_horovod_startup.py --check       # exit 1 if the unset hook takes >= 1 ms

1. The hook itself, with the variable unset: ``site.addpackage`` on the installed .pth file, the
   call that ``site`` makes for it at every interpreter start (open and read the file, exec its
   line), timed in this process; the median and the 99th percentile.
2. End to end, with and without the hook: ``python -c pass`` in bare virtual environments made
   for the run (no packages): one with a copy of the hook in its site-packages, one without,
   and one with a .pth whose line is only ``import os`` (what any executable .pth line costs,
   setuptools' own distutils-precedence.pth among them); the variable unset, median wall time
   of alternating starts.
3. For scale: ``python -c pass`` in this environment with the variable unset, and set (the
   finder installed: bagua_hvd.as_horovod imported), median wall time of alternating starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import site
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path
from typing import List

HOOK = "bagua_hvd_as_horovod.pth"
VAR = "BAGUA_HVD_AS_HOROVOD"


def installed_hook() -> Path:
    for folder in site.getsitepackages() + [site.getusersitepackages()]:
        if (Path(folder) / HOOK).exists():
            return Path(folder) / HOOK
    sys.exit(f"{HOOK} is not installed in this interpreter's site-packages (pip install -e .)")


def hook_cost_us(hook: Path, runs: int) -> List[float]:
    """Microseconds per ``site.addpackage`` of the hook, variable unset."""
    os.environ.pop(VAR, None)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        site.addpackage(str(hook.parent), hook.name, set())
        out.append((time.perf_counter() - t) * 1e6)
    return out


def start_ms(runs: int) -> dict:
    """Median ms of ``python -c pass`` here per setting of the variable, runs alternating."""
    times: dict = {"unset": [], "set": []}
    base = {k: v for k, v in os.environ.items() if k != VAR}
    for _ in range(runs):
        for name, env in (("unset", base), ("set", dict(base, **{VAR: "1"}))):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
            times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def _median_starts(pythons: dict, env: dict, runs: int) -> dict:
    """Median ms of ``python -c pass`` for each of ``pythons`` (name: executable), alternating."""
    times: dict = {name: [] for name in pythons}
    for _ in range(runs):
        for name, python in pythons.items():
            t = time.perf_counter()
            subprocess.run([python, "-c", "pass"], env=env, check=True)
            times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def with_and_without_ms(hook: Path, runs: int) -> dict:
    """Median ms of ``python -c pass`` in bare venvs: without the hook, with it (unset), and with
    an ``import os`` .pth."""
    root = Path(tempfile.mkdtemp(prefix="as_horovod_startup."))
    try:
        pythons = {}
        for name in ("without", "with", "import os"):
            venv.EnvBuilder(with_pip=False, symlinks=True).create(root / name)
            pythons[name] = str(root / name / "bin" / "python")
            site_dir = subprocess.run(
                [pythons[name], "-c", "import site; print(site.getsitepackages()[0])"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            if name == "with":
                shutil.copy(hook, Path(site_dir) / HOOK)
            elif name == "import os":
                (Path(site_dir) / "control.pth").write_text("import os\n")
        env = {k: v for k, v in os.environ.items() if k not in (VAR, "PYTHONPATH")}
        return _median_starts(pythons, env, runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="hook runs (default 2000)")
    parser.add_argument(
        "--starts", type=int, default=100, help="interpreter starts per setting (default 100)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless the hook < 1 ms")
    args = parser.parse_args()
    hook = installed_hook()
    costs = sorted(hook_cost_us(hook, args.runs))
    median, p99 = statistics.median(costs), costs[int(0.99 * (len(costs) - 1))]
    print(f"hook {hook}")
    print(f"hook, {VAR} unset: median {median:.1f} us, p99 {p99:.1f} us ({args.runs} runs)")
    if args.starts:
        ms = with_and_without_ms(hook, args.starts)
        print(
            f"python -c pass, bare venv, {VAR} unset: without the hook {ms['without']:.2f} ms, "
            f"with it {ms['with']:.2f} ms ({ms['with'] - ms['without']:+.2f} ms), with an "
            f"'import os' .pth {ms['import os']:.2f} ms ({ms['import os'] - ms['without']:+.2f} "
            f"ms) (medians of {args.starts})"
        )
        ms = start_ms(args.starts)
        print(
            f"python -c pass: {VAR} unset {ms['unset']:.1f} ms, set {ms['set']:.1f} ms "
            f"(medians of {args.starts})"
        )
    if args.check and median >= 1000:
        print("the unset hook takes 1 ms or more", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
