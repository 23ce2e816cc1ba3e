"""Latency of small allreduces through bagua_hvd.torch (not a test; run it in the launcher).

    bagua-run -np 2 python tests/mp/bench_torch_allreduce.py [bytes ...]

Prints, per size, the median and p90 time per call (max over ranks) for allreduce (out of
place), allreduce_ (in place) and the framework-neutral layer alone, so that the frontend's
own overhead can be told apart from the core's.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common import ops


def _timed(fn, iters: int) -> list:
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _report(label: str, samples: list) -> None:
    med = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    p90 = torch.tensor([sorted(samples)[int(len(samples) * 0.9)]], dtype=torch.float64)
    med = hvd.allreduce(med, op=hvd.Max, name="bench.med").item()
    p90 = hvd.allreduce(p90, op=hvd.Max, name="bench.p90").item()
    if hvd.rank() == 0:
        print(f"{label:<40} median {med * 1e6:8.1f} us   p90 {p90 * 1e6:8.1f} us", flush=True)


def _cases(x: torch.Tensor) -> list:
    desc = [(x.data_ptr(), ops.FLOAT32, tuple(x.shape))]

    def raw() -> None:
        h, _ = ops.enqueue(ops.OP_ALLREDUCE, desc, desc, reduce_op=ops.Sum, urgent=True)
        ops.wait(h)
        ops.release(h)

    return [
        ("allreduce (out of place)", lambda: hvd.allreduce(x, op=hvd.Sum)),
        ("allreduce_ (in place)", lambda: hvd.allreduce_(x, op=hvd.Sum)),
        ("allreduce named", lambda: hvd.allreduce(x, op=hvd.Sum, name="bench.named")),
        ("common.ops enqueue+wait (no torch)", raw),
    ]


def main() -> None:
    hvd.init()
    sizes = [int(a) for a in sys.argv[1:]] or [4096]
    iters = 2000
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        for label, fn in _cases(x):
            _timed(fn, 200)  # warm-up
            hvd.barrier()
            _report(f"{nbytes} B {label}", _timed(fn, iters))
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
