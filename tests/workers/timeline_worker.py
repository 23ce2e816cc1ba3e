"""Rank side of tests/test_timeline.py: bench/_timeline.py's tracer around a few steps of a small
model (three 600x600 layers, one per bucket) with ByteGrad, LowPrecisionDecentralized and
Horovod's allreduce; rank 0 prints each mode's last traced step as JSON."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ["BAGUA_HVD_BUCKET_MB"] = "1.5"  # one 600x600 layer (+ bias, 1.4 MiB) per bucket

import _timeline  # noqa: E402
import torch  # noqa: E402

import bagua_hvd.torch as hvd  # noqa: E402
from bagua_hvd.torch.algorithms import (  # noqa: E402
    ByteGrad,
    GradientAllReduce,
    LowPrecisionDecentralized,
)


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    tracer = _timeline.Tracer()
    _timeline.install(tracer)
    out = {"has_core": tracer.has_core}
    gen = torch.Generator().manual_seed(5 + hvd.rank())
    x = torch.randn(16, 600, generator=gen)
    for mode, alg in (
        ("bytegrad", ByteGrad()),
        ("low_precision_decentralized", LowPrecisionDecentralized()),
        ("gradient_allreduce", GradientAllReduce()),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(600, 600) for _ in range(3)))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=[(f"{mode}.{k}", p) for k, p in model.named_parameters()],
            algorithm=alg,
        )
        steps = []
        for step in range(4):
            if step >= 2:
                tracer.begin_step()
            opt.zero_grad()
            model(x).square().mean().backward()
            tracer.mark("backward ends")
            opt.step()
            if step >= 2:
                steps.append({"t0": tracer.t0, "events": tracer.end_step()})
        if hasattr(opt, "_algo_impl") and mode == "low_precision_decentralized":
            opt._algo_impl.flush()
        out[mode] = {"buckets": len(opt._buckets), "steps": steps}
        hvd.barrier()
    if hvd.rank() == 0:
        print("TIMELINE " + json.dumps(out))
    hvd.shutdown()


if __name__ == "__main__":
    main()
