"""Allreduce latency and bus bandwidth: bagua_hvd beside torch.distributed (gloo), one invocation.

    python bench/allreduce.py                   # 2 ranks on this host, default transport (shm)
    python bench/allreduce.py --transport tcp   # BAGUA_HVD_TRANSPORT=tcp for bagua_hvd
    python bench/allreduce.py --np 2 --sizes 4K,1M --backends gloo
    python bench/allreduce.py --op adasum --np 4 # bagua_hvd's Adasum beside gloo's sum

The script launches itself through bagua-run (`python -m bagua_hvd.runner.launch`). Every rank
then initializes bagua_hvd and a gloo process group on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), so the
two libraries are measured in the same processes, on the same data.

Method (docs/benchmarks.md): float32 sum; per size, each library runs a block of warm-up and
timed iterations, in A-B-B-A order over two halves; each timed iteration is preceded by that library's own barrier and its input
is refilled outside the timed region; the iteration's time is the max over ranks; the table shows
the median over iterations. Every result is checked against the exact expected sum.
busbw = 2(n-1)/n * bytes / time (MB = 1e6 B).

--op adasum: bagua_hvd runs op=hvd.Adasum (Horovod's; a power-of-2 number of ranks), gloo has no
Adasum and runs the sum of the same tensor: the ratio is what Adasum costs over a plain
allreduce of the same bytes. Rank r's input is (r + 1) times one vector, whose Adasum is the
mean (parallel vectors), so the check stays exact.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import free_port, run_ranks  # noqa: E402

DEFAULT_SIZES = "4K,64K,1M,16M,64M"
PORT_ENV = "BAGUA_HVD_BENCH_GLOO_PORT"
TUNING_ENV = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "BAGUA_HVD_TRANSPORT")
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"  # rank 0 writes the medians there (JSON)
WORKER_FLAG = "--_worker"
BACKENDS = ("bagua_hvd", "gloo")
# Timeout of every gloo collective and of the gloo rendezvous.
GLOO_TIMEOUT = datetime.timedelta(seconds=120)
# Goals of the issue (docs/benchmarks.md).
SHM_SMALL_BYTES, SHM_SMALL_MAX_MS = 4096, 0.1
SHM_LARGE_BYTES, SHM_LARGE_MIN_RATIO = 1 << 20, 2.0
TCP_MIN_RATIO = 1.0


def parse_size(text: str) -> int:
    """'4K' -> 4096, '1M' -> 1048576, '512' -> 512 (bytes; multiples of 4 for float32)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"bad size {text!r}: expected a number of bytes with optional K/M/G")
    value = (
        int(match.group(1))
        * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[match.group(2).upper()]
    )
    if value <= 0 or value % 4:
        raise ValueError(f"bad size {text!r}: must be a positive multiple of 4 bytes (float32)")
    return value


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def iterations_for(nbytes: int) -> int:
    """50 iterations up to 1 MiB, 20 up to 16 MiB, 10 above (as in the peers' measurements)."""
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 20
    return 10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Allreduce benchmark: bagua_hvd vs torch.distributed gloo",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--np", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--sizes",
        default=DEFAULT_SIZES,
        help=f"comma-separated byte sizes (default {DEFAULT_SIZES})",
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "shm", "tcp"),
        default="auto",
        help="bagua_hvd transport between ranks of one host (sets BAGUA_HVD_TRANSPORT)",
    )
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help="comma-separated subset of bagua_hvd,gloo (default both)",
    )
    parser.add_argument(
        "--op",
        choices=("sum", "adasum"),
        default="sum",
        help="bagua_hvd's reduction (gloo always sums; default sum)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="warm-up iterations per size")
    parser.add_argument(
        "--iters", type=int, default=0, help="timed iterations per size (default: 50/20/10 by size)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds before the whole run is killed"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the medians to FILE (JSON)")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error(f"--np must be >= 1, got {args.np}")
    if args.warmup < 0 or args.iters < 0:
        parser.error("--warmup and --iters must be >= 0")
    try:
        args.size_list = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not args.size_list:
        parser.error("--sizes is empty")
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(args.backend_list) - set(BACKENDS))
    if unknown or not args.backend_list:
        parser.error(f"--backends: unknown {unknown or 'empty list'}; choose from {BACKENDS}")
    return args


# ---- launcher side --------------------------------------------------------------------------


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Re-runs this script on --np ranks through bagua-run, then prints rank 0's results."""
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_") as tmp:
        result_path = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        env[PORT_ENV] = str(free_port())
        env[RESULT_ENV] = result_path
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["OMP_NUM_THREADS"] = "1"
        if args.transport != "auto":
            env["BAGUA_HVD_TRANSPORT"] = args.transport
        rc = run_ranks(
            args.np,
            [sys.executable, os.path.abspath(__file__), *argv, WORKER_FLAG],
            env,
            args.timeout,
        )
        if rc is None:
            print(
                f"allreduce bench: no result after --timeout {args.timeout:g} s; stopped",
                file=sys.stderr,
            )
            return 124
        if rc != 0:
            print(f"allreduce bench: the ranks failed (launcher exit status {rc})", file=sys.stderr)
            return rc
        if not os.path.exists(result_path):
            print(f"allreduce bench: rank 0 wrote no results to {result_path}", file=sys.stderr)
            return 1
        with open(result_path) as f:
            result = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_table(args, result)
    return 0


# ---- worker side ----------------------------------------------------------------------------


@dataclass
class Result:
    times: dict[str, list[float]] = field(default_factory=dict)  # backend -> max-over-ranks s


class Bench:
    """Both backends in one process; rank and size come from the launcher's environment."""

    def __init__(self, args: argparse.Namespace):
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self.torch, self.dist, self.args = torch, dist, args
        self.hvd = None
        if "bagua_hvd" in args.backend_list:
            import bagua_hvd.torch as hvd

            hvd.init()
            self.hvd = hvd
            self.rank, self.size = hvd.rank(), hvd.size()
        else:
            self.rank = int(os.environ.get("HOROVOD_RANK", "0"))
            self.size = int(os.environ.get("HOROVOD_SIZE", "1"))
        port = os.environ.get(PORT_ENV)
        if port is None:
            raise RuntimeError(
                f"{PORT_ENV} is not set: run bench/allreduce.py without "
                f"{WORKER_FLAG}, it launches itself"
            )
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=self.size,
            timeout=GLOO_TIMEOUT,
        )

    def transport(self) -> str:
        if self.hvd is None or self.size == 1:
            return "-"
        try:
            from bagua_hvd.common import _native

            name = _native.lib().bhvd_transport_name((self.rank + 1) % self.size)
            return _native.ffi.string(name).decode()
        except Exception as exc:  # informative only; the env var is what was asked for
            return f"{os.environ.get('BAGUA_HVD_TRANSPORT', 'default')} ({exc.__class__.__name__})"

    def run_one(self, backend: str, buf, src, expected: dict, name: str) -> float:
        """One iteration: refill, barrier, timed allreduce, check. Returns this rank's seconds."""
        torch, dist = self.torch, self.dist
        buf.copy_(src)
        # Each library is timed after its own barrier: the ranks then leave it about together,
        # as they would in a training step, and one library's wake-up skew does not bill the
        # other (gloo's barrier alone costs ~0.5 ms with a skew of the same order).
        if backend == "gloo":
            dist.barrier()
        else:
            self.hvd.barrier()
        start = time.perf_counter()
        if backend == "gloo":
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        else:
            op = self.hvd.Adasum if self.args.op == "adasum" else self.hvd.Sum
            self.hvd.allreduce_(buf, name=name, op=op)
        elapsed = time.perf_counter() - start
        expected = expected[backend]
        if not torch.equal(buf, expected):
            bad = (buf != expected).nonzero()[0].item()
            raise RuntimeError(
                f"{backend} allreduce of {buf.numel()} float32 gave a wrong result on rank "
                f"{self.rank}: element {bad} is {buf[bad].item()}, expected {expected[bad].item()}"
            )
        return elapsed

    def measure(self, nbytes: int) -> Result:
        torch, dist = self.torch, self.dist
        n = nbytes // 4
        # Small integers: every partial sum is exact in float32, so the check can be exact.
        base = (torch.arange(n, dtype=torch.int64) % 251).to(torch.float32)
        src = base * (self.rank + 1)
        total = base * (self.size * (self.size + 1) // 2)
        # Adasum of parallel vectors is their mean.
        adasum = base * ((self.size + 1) / 2)
        expected = {"gloo": total, "bagua_hvd": adasum if self.args.op == "adasum" else total}
        buf = torch.empty_like(src)
        iters = self.args.iters or iterations_for(nbytes)
        name = f"bench.allreduce.{nbytes}"
        # One block of iterations per library, in ABBA order across halves so that slow drift
        # of the machine hits both alike. Blocks rather than alternating single iterations:
        # gloo's worker threads stay busy for a while after each of its ops and would bill
        # their wake-ups to whichever library runs next.
        local = {b: [] for b in self.args.backend_list}
        order = list(self.args.backend_list)
        for half in range(2):
            for backend in order if half == 0 else reversed(order):
                for _ in range(self.args.warmup):
                    self.run_one(backend, buf, src, expected, name)
                for _ in range((iters + 1 - half) // 2):
                    local[backend].append(self.run_one(backend, buf, src, expected, name))
        result = Result()
        for backend, times in local.items():
            t = torch.tensor(times, dtype=torch.float64)
            # An iteration lasts as long as its slowest rank.
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            result.times[backend] = t.tolist()
        return result

    def close(self) -> None:
        self.dist.destroy_process_group()
        if self.hvd is not None:
            self.hvd.shutdown()


def bus_bw(nbytes: int, seconds: float, size: int) -> float:
    """MB/s (1e6 B) of bus bandwidth: 2(n-1)/n * bytes / time; algbw when n == 1."""
    factor = 2 * (size - 1) / size if size > 1 else 1.0
    return factor * nbytes / seconds / 1e6


def worker(args: argparse.Namespace) -> int:
    bench = Bench(args)
    rows = []
    for nbytes in args.size_list:
        result = bench.measure(nbytes)
        medians = {b: statistics.median(t) for b, t in result.times.items()}
        rows.append([nbytes, medians])
        if bench.rank == 0:
            cells = "  ".join(f"{b} {m * 1e3:.3f} ms" for b, m in medians.items())
            print(f"{human(nbytes)}: {cells}", flush=True)
    if bench.rank == 0:
        import torch

        result = {
            "size": bench.size,
            "transport": bench.transport(),
            "torch": torch.__version__,
            "rows": rows,  # [bytes, {backend: median seconds}]
            "env": {k: v for k, v in sorted(os.environ.items()) if k in TUNING_ENV},
        }
        path = os.environ.get(RESULT_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(result, f)
        else:  # started by hand: print what the launcher would have
            print_table(args, result)
    bench.close()
    return 0


def print_table(args: argparse.Namespace, result: dict) -> None:
    size, transport, rows = result["size"], result["transport"], result["rows"]
    print(
        f"\nallreduce float32 {'Adasum (bagua_hvd) / sum (gloo)' if args.op == 'adasum' else 'sum'}, {size} ranks on one host, bagua_hvd transport: {transport}, "
        f"torch {result['torch']}, 1 torch thread per rank; median over iterations of the max "
        f"over ranks; busbw in MB/s (1e6 B/s)"
    )
    tuning = " ".join(f"{k}={v}" for k, v in result.get("env", {}).items())
    print(f"environment: {tuning or 'defaults'}\n")
    print("| size | bagua_hvd ms | bagua_hvd busbw | gloo ms | gloo busbw | gloo/bagua_hvd |")
    print("|---|---:|---:|---:|---:|---:|")

    def cell(m: dict, b: str, nbytes: int) -> tuple[str, str]:
        if b not in m:
            return "-", "-"
        return f"{m[b] * 1e3:.3f}", f"{bus_bw(nbytes, m[b], size):.0f}"

    goals = []
    for nbytes, medians in rows:
        bt, bb = cell(medians, "bagua_hvd", nbytes)
        gt, gb = cell(medians, "gloo", nbytes)
        ratio = "-"
        if "bagua_hvd" in medians and "gloo" in medians:
            r = medians["gloo"] / medians["bagua_hvd"]
            ratio = f"{r:.2f}x"
            goals.append((nbytes, medians["bagua_hvd"], r))
        print(f"| {human(nbytes)} | {bt} | {bb} | {gt} | {gb} | {ratio} |")
    if not goals or size < 2 or args.op != "sum":  # the goals are the sum's
        return
    print()
    if args.transport == "tcp" or transport.startswith("tcp"):
        worst = min(goals, key=lambda g: g[2])
        print(
            f"goal (tcp) >= {TCP_MIN_RATIO:.1f}x gloo at every size: "
            f"{'met' if worst[2] >= TCP_MIN_RATIO else 'NOT met'} "
            f"(lowest {worst[2]:.2f}x at {human(worst[0])})"
        )
        return
    for nbytes, t, _ in goals:
        if nbytes == SHM_SMALL_BYTES:
            print(
                f"goal (shm) 4 KiB < {SHM_SMALL_MAX_MS} ms: "
                f"{'met' if t * 1e3 < SHM_SMALL_MAX_MS else 'NOT met'} ({t * 1e3:.3f} ms)"
            )
    large = [g for g in goals if g[0] >= SHM_LARGE_BYTES]
    if large:
        worst = min(large, key=lambda g: g[2])
        print(
            f"goal (shm) >= {SHM_LARGE_MIN_RATIO:.1f}x gloo at >= 1 MiB: "
            f"{'met' if worst[2] >= SHM_LARGE_MIN_RATIO else 'NOT met'} "
            f"(lowest {worst[2]:.2f}x at {human(worst[0])})"
        )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
