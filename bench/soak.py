"""Soak (issue 15): a long job at 2 ranks must not grow.

    python bench/soak.py                       # 50,000 steps at 2 ranks, a report every 5,000
    python bench/soak.py --steps 5000 --report-every 500   # a short run

Every step trains a small MLP with hvd.DistributedOptimizer (its allreduces fused by the core)
and runs one more of Horovod's operations in turn, each checked against numpy: allreduce,
allreduce_async + synchronize, grouped_allreduce, allgather (a different first dimension per
rank), broadcast, alltoall (uneven splits), reducescatter, grouped_allgather,
grouped_reducescatter, broadcast_object, barrier. Every --mismatch-every steps the ranks submit
one tensor with different shapes: every rank must get Horovod's mismatch error and the job goes
on. Every --report-every steps each rank measures its resident set (VmRSS), threads
(/proc/self/task), open file descriptors (/proc/self/fd) and the frontend's outstanding handles;
rank 0 prints them for every rank. At the end: each quantity's slope per 10,000 steps over the
reports after the first (the first report closes the warm-up: caches, pools and the response
cache fill there), and whether it is flat: threads, descriptors and handles unchanged, the
resident set within --rss-noise-mib of its value at the first report.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import read_status_kib, run_ranks  # noqa: E402

WORKER_FLAG = "--_worker"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Soak: a long 2-rank job must not grow (RSS, threads, fds, handles)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--np", type=int, default=2, help="ranks on this host")
    parser.add_argument("--steps", type=int, default=50_000, help="training steps")
    parser.add_argument("--report-every", type=int, default=5_000, help="steps between reports")
    parser.add_argument(
        "--mismatch-every", type=int, default=1_000, help="steps between mismatch errors"
    )
    parser.add_argument(
        "--rss-noise-mib",
        type=float,
        default=8.0,
        help="resident-set change (MiB, first report to last) still counted as flat",
    )
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds for the job")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("np", "steps", "report_every", "mismatch_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.np < 2:
        parser.error("--np must be >= 2 (the soak is of communication)")
    return args


# ---- worker side ----------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.torch import mpi_ops

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 + rank)

    def ranks_values(i: int, n: int) -> list:
        """Every rank's input of step i (n values each), the same on every rank."""
        return [np.arange(n, dtype=np.float32) * (r + 1) + i % 97 for r in range(size)]

    def check(got, want, what: str, i: int) -> None:
        if not np.array_equal(np.asarray(got), np.asarray(want)):
            raise AssertionError(f"step {i}: {what}: got {got}, want {want}")

    def one_op(i: int) -> None:
        k = i % 11
        vals = ranks_values(i, 8)
        mine = torch.from_numpy(vals[rank])
        total = sum(vals)
        if k == 0:
            check(hvd.allreduce(mine, op=hvd.Sum, name="soak.ar").numpy(), total, "allreduce", i)
        elif k == 1:
            h = hvd.allreduce_async(mine, op=hvd.Sum, name="soak.ara")
            check(hvd.synchronize(h).numpy(), total, "allreduce_async", i)
        elif k == 2:
            outs = hvd.grouped_allreduce([mine, mine[:3]], op=hvd.Sum, name="soak.gar")
            check(outs[0].numpy(), total, "grouped_allreduce[0]", i)
            check(outs[1].numpy(), total[:3], "grouped_allreduce[1]", i)
        elif k == 3:
            got = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="soak.ag")
            want = np.concatenate([np.full((r + 1, 2), float(r), np.float32) for r in range(size)])
            check(got.numpy(), want, "allgather", i)
        elif k == 4:
            got = hvd.broadcast(mine, root_rank=i % size, name="soak.bc")
            check(got.numpy(), vals[i % size], "broadcast", i)
        elif k == 5:
            splits = torch.tensor(
                [r + 1 for r in range(size)], dtype=torch.int32
            )  # r + 1 rows to r
            x = torch.full((int(splits.sum()),), float(rank))
            got, _ = hvd.alltoall(x, splits=splits, name="soak.a2a")
            want = np.concatenate([np.full(rank + 1, float(r), np.float32) for r in range(size)])
            check(got.numpy(), want, "alltoall", i)
        elif k == 6:
            x = torch.from_numpy(np.stack([vals[rank]] * size))
            got = hvd.reducescatter(x, op=hvd.Sum, name="soak.rs")
            check(got.numpy(), total[None, :], "reducescatter", i)
        elif k == 7:
            outs = hvd.grouped_allgather([mine[:2], mine[:1]], name="soak.gag")
            check(outs[0].numpy(), np.concatenate([v[:2] for v in vals]), "grouped_allgather", i)
            check(outs[1].numpy(), np.concatenate([v[:1] for v in vals]), "grouped_allgather", i)
        elif k == 8:
            x = torch.from_numpy(np.stack([vals[rank]] * size))
            (got,) = hvd.grouped_reducescatter([x], op=hvd.Sum, name="soak.grs")
            check(got.numpy(), total[None, :], "grouped_reducescatter", i)
        elif k == 9:
            got = hvd.broadcast_object({"step": i, "from": 0}, root_rank=0, name="soak.obj")
            check(got["step"], i, "broadcast_object", i)
        else:
            hvd.barrier()

    def mismatch(i: int) -> None:
        try:
            hvd.allreduce(torch.ones(rank + 2), name="soak.mismatch")
        except hvd.HorovodInternalError as e:
            if "Mismatched" not in str(e):
                raise AssertionError(f"step {i}: unexpected error text: {e}") from e
            return
        raise AssertionError(f"step {i}: no error for mismatched shapes")

    def measure() -> list:
        return [
            read_status_kib("VmRSS") / 1024,
            len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")),
            len(mpi_ops._handle_map),
        ]

    reports = []  # (step, [per rank [rss, threads, fds, handles]])
    start = time.monotonic()
    loss = torch.zeros(())
    for i in range(1, args.steps + 1):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        one_op(i)
        if i % args.mismatch_every == 0:
            mismatch(i)
        if i % args.report_every == 0:
            every = hvd.allgather(torch.tensor([measure()], dtype=torch.float64), name="soak.m")
            reports.append((i, every.tolist()))
            if rank == 0:
                per = "; ".join(
                    f"rank {r}: RSS {v[0]:.1f} MiB, {v[1]:.0f} threads, {v[2]:.0f} fds, "
                    f"{v[3]:.0f} handles"
                    for r, v in enumerate(every.tolist())
                )
                print(
                    f"step {i}: {time.monotonic() - start:.0f} s, loss {loss.item():.4f}; {per}",
                    flush=True,
                )
    if rank == 0:
        print(summary(reports, args), flush=True)
    hvd.shutdown()
    return 0


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def summary(reports: list, args: argparse.Namespace) -> str:
    if len(reports) < 3:
        return "soak: fewer than 3 reports: no slope (raise --steps or lower --report-every)"
    after = reports[1:]  # the first report closes the warm-up
    steps = [s for s, _ in after]
    names = ("RSS MiB", "threads", "fds", "handles")
    lines = [f"soak: {args.steps} steps at {len(reports[0][1])} ranks; slopes per 10,000 steps "
             f"over the reports from step {steps[0]} (first report = warm-up):"]  # fmt: skip
    flat = True
    for q, name in enumerate(names):
        for r in range(len(reports[0][1])):
            ys = [per[r][q] for _, per in after]
            s = slope(steps, ys) * 10_000
            first, last = reports[0][1][r][q], ys[-1]
            ok = abs(last - first) <= args.rss_noise_mib if q == 0 else last == first
            flat &= ok
            lines.append(
                f"  rank {r} {name}: {first:.1f} at step {reports[0][0]} -> {last:.1f} at step "
                f"{steps[-1]}, slope {s:+.3f} per 10k steps: {'flat' if ok else 'GROWS'}"
            )
    lines.append(
        f"soak verdict: {'flat' if flat else 'NOT flat'} (threads, fds and handles unchanged "
        f"after the warm-up, RSS within {args.rss_noise_mib:g} MiB)"
    )
    return "\n".join(lines)


# ---- launcher side --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args._worker:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), WORKER_FLAG, "--steps", str(args.steps),
           "--report-every", str(args.report_every), "--mismatch-every",
           str(args.mismatch_every), "--rss-noise-mib", str(args.rss_noise_mib),
           "--np", str(args.np)]  # fmt: skip
    started = time.monotonic()
    rc = run_ranks(args.np, cmd, env, args.timeout)
    if rc is None:
        print(f"soak: no end after --timeout {args.timeout:g} s", file=sys.stderr)
        return 1
    print(f"soak: the job ended with status {rc} after {time.monotonic() - started:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
