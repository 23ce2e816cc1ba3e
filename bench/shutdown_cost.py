"""What ``hvd.shutdown()`` costs now that ranks end a job together (native/src/core/farewell.cc:
a bye to every peer, then a wait for theirs), beside the cheapest collective of the same job.

    python bench/shutdown_cost.py [--np 4] [--jobs 20]

Runs ``--jobs`` jobs in a row under ``bagua-run -np N`` on this host; in each, every rank times
one allreduce of 1000 floats (the peer: one negotiation round and a collective) and then
``hvd.shutdown()``. Prints each rank's medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(jobs: int) -> None:
    import torch

    import bagua_hvd.torch as hvd

    allreduce, shutdown = [], []
    for j in range(jobs):
        hvd.init()
        x = torch.ones(1000)
        hvd.allreduce(x, name=f"warm.{j}")  # connections and caches set up
        t0 = time.perf_counter()
        hvd.allreduce(x, name=f"timed.{j}")
        t1 = time.perf_counter()
        rank = hvd.rank()
        hvd.shutdown()
        t2 = time.perf_counter()
        allreduce.append(t1 - t0)
        shutdown.append(t2 - t1)
    print("RESULT " + json.dumps({"rank": rank, "allreduce_ms": statistics.median(allreduce) * 1e3,
                                  "shutdown_ms": statistics.median(shutdown) * 1e3}), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.jobs)
        return
    cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(args.np), sys.executable,
           os.path.abspath(__file__), "--worker", "--jobs", str(args.jobs)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = sorted((json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines()
                   if "RESULT " in line), key=lambda r: r["rank"])  # fmt: skip
    print(f"{args.np} ranks on this host, {args.jobs} jobs, medians per rank:")
    for r in rows:
        print(f"  rank {r['rank']}: allreduce {r['allreduce_ms']:.3f} ms, "
              f"shutdown {r['shutdown_ms']:.3f} ms, "
              f"ratio {r['shutdown_ms'] / r['allreduce_ms']:.1f}")  # fmt: skip
    ratio = statistics.median(r["shutdown_ms"] / r["allreduce_ms"] for r in rows)
    print(f"shutdown / allreduce (median over ranks): {ratio:.1f}")


if __name__ == "__main__":
    main()
