"""What the start-up hook of ``BAGUA_HVD_AS_HOROVOD`` (bagua_hvd_as_horovod.pth, installed into
site-packages by ``pip install``) costs every Python process of the environment.

    python bench/as_horovod_startup.py               # 2000 hook runs, 40 interpreter starts
    python bench/as_horovod_startup.py --check       # exit 1 if the unset hook takes >= 1 ms

1. The hook itself, with the variable unset: ``site.addpackage`` on the installed .pth file, the
   call that ``site`` makes for it at every interpreter start (open and read the file, exec its
   line), timed in this process; the median and the 99th percentile.
2. For scale: ``python -c pass`` with the variable unset, and set (the finder installed:
   bagua_hvd.as_horovod imported), median wall time of alternating runs.
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import sys
import time
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
    """Median ms of ``python -c pass`` per setting of the variable, runs alternating."""
    times: dict = {"unset": [], "set": []}
    base = {k: v for k, v in os.environ.items() if k != VAR}
    for _ in range(runs):
        for name, env in (("unset", base), ("set", dict(base, **{VAR: "1"}))):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
            times[name].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2000, help="hook runs (default 2000)")
    parser.add_argument("--starts", type=int, default=40, help="interpreter starts per setting")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the hook < 1 ms")
    args = parser.parse_args()
    hook = installed_hook()
    costs = sorted(hook_cost_us(hook, args.runs))
    median, p99 = statistics.median(costs), costs[int(0.99 * (len(costs) - 1))]
    print(f"hook {hook}")
    print(f"hook, {VAR} unset: median {median:.1f} us, p99 {p99:.1f} us ({args.runs} runs)")
    if args.starts:
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
