"""Does ``algorithm=Auto(...)`` cost anything once it has chosen? (issue 40: "auto ... its
steady state within 3 % of that algorithm run alone").

    python bench/auto_overhead.py                     # 2 ranks, 8 blocks of 60 steps
    python bench/auto_overhead.py --malloc default    # glibc's allocator settings as they are

Modes, each between an hvd.init() and an hvd.shutdown() of its own, in ABBA blocks:
  gar    DistributedOptimizer(algorithm=GradientAllReduce()): the peer
  auto1  Auto([GradientAllReduce()]): Auto's path alone, nothing else ever run
  auto   Auto([GradientAllReduce(), ByteGrad()]) made to choose GradientAllReduce (the test hook
         BAGUA_HVD_TEST_ALGORITHM_DELAY=ByteGrad:0.05 slows ByteGrad's measured steps), timed
         after its choice: what ByteGrad's measurement leaves behind

Model and figures as bench/autotune.py: 100 x Linear(128, 128) with ReLU, batch 32 per rank,
SGD, 1 torch thread per rank; a block's figure is the slowest rank's median step time. Prints
each mode's per-block times and, per mode, the per-block ratios to gar and their geometric
mean. ``--malloc steady`` (the default) sets bench/train.py's STEADY_MALLOC as every bench here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_ranks  # noqa: E402
from train import STEADY_MALLOC  # noqa: E402

WORKER_FLAG = "--_worker"
RESULT_ENV = "BAGUA_HVD_BENCH_RESULT"
MODES = ("gar", "auto1", "auto")
LAYERS, WIDTH, BATCH, LR = 100, 128, 32, 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--blocks", type=int, default=8, help="ABBA blocks (each mode once per block)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per mode per block")
    p.add_argument("--malloc", choices=("steady", "default"), default="steady")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("np", "blocks", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def worker(args: argparse.Namespace) -> int:
    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.torch import algorithms as algs

    torch.set_num_threads(1)
    rank = int(os.environ["HOROVOD_RANK"])
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    y = torch.randint(0, WIDTH, (BATCH,), generator=gen)
    F = torch.nn.functional
    make = {
        "gar": lambda: algs.GradientAllReduce(),
        "auto1": lambda: algs.Auto([algs.GradientAllReduce()], verbose=False),
        "auto": lambda: algs.Auto([algs.GradientAllReduce(), algs.ByteGrad()], verbose=False),
    }
    out: dict = {m: [] for m in MODES}
    for b in range(args.blocks):
        for mode in MODES if b % 2 == 0 else MODES[::-1]:
            hvd.init()
            torch.manual_seed(0)
            layers: list = []
            for _ in range(LAYERS):
                layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
            model = torch.nn.Sequential(*layers[:-1])
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR),
                named_parameters=[(f"{mode}.{b}.{k}", p) for k, p in model.named_parameters()],
                algorithm=make[mode](),
            )

            def step(model=model, opt=opt) -> None:
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

            # Auto's default schedule (2 + 2 x 2 x 4 steps) and a few more; the others alike.
            for _ in range(24):
                step()
            if mode != "gar":
                state = opt.state_dict()["bagua_hvd_auto"]
                if state["chosen"] != 0:
                    raise RuntimeError(f"{mode}: Auto chose {state} instead of GradientAllReduce")
            marks = [time.perf_counter()]
            for _ in range(args.steps):
                step()
                marks.append(time.perf_counter())
            median = statistics.median(t1 - t0 for t0, t1 in zip(marks, marks[1:]))
            slowest = hvd.allreduce(torch.tensor([median]), op=hvd.Max, name=f"bench.{mode}.{b}")
            out[mode].append(float(slowest[0]))
            del opt, model, step
            hvd.shutdown()
    if rank == 0:
        with open(os.path.join(os.environ[RESULT_ENV], "result.json"), "w") as f:
            json.dump(out, f)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._worker:
        return worker(args)
    with tempfile.TemporaryDirectory(prefix="bagua_hvd_bench_auto_") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env["BAGUA_HVD_TEST_ALGORITHM_DELAY"] = "ByteGrad:0.05"
        env[RESULT_ENV] = tmp
        if args.malloc == "steady":
            for key, value in STEADY_MALLOC.items():
                env.setdefault(key, value)
        argv_w = [sys.executable, os.path.abspath(__file__), WORKER_FLAG,
                  "--blocks", str(args.blocks), "--steps", str(args.steps)]  # fmt: skip
        rc = run_ranks(args.np, argv_w, env, args.timeout)
        if rc != 0:
            print(f"auto_overhead bench: the job {'timed out' if rc is None else f'exited {rc}'}",
                  file=sys.stderr)  # fmt: skip
            return 1
        with open(os.path.join(tmp, "result.json")) as f:
            out = json.load(f)
    print(f"{args.np} ranks, {args.blocks} blocks x {args.steps} steps, malloc {args.malloc}; "
          "slowest rank's median step (ms) per block")  # fmt: skip
    for mode in MODES:
        times = " ".join(f"{t * 1e3:6.2f}" for t in out[mode])
        print(f"  {mode:<6} {times}   median {statistics.median(out[mode]) * 1e3:.2f}")
    for mode in MODES[1:]:
        ratios = [a / b for a, b in zip(out[mode], out["gar"])]
        print(f"  {mode} / gar (step time) per block: "
              + " ".join(f"{r:.3f}" for r in ratios)
              + f"; geometric mean {statistics.geometric_mean(ratios):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
