"""A rank of tests/test_autotune.py's jobs (HOROVOD_AUTOTUNE=1 set by the test).

ops <max steps> <out>: until rank 0's tuner ends (checked every 10 steps), each step allreduces 24 small tensors asynchronously and waits; rank 1 sleeps
  a random 0-4 ms before each step, so that the ranks' timings differ.
tf-ops <steps> <out>: the same through the TensorFlow frontend (a grouped allreduce a step).
optimizer <max steps> <out>: until tuning ends, then 5 steps more: hvd.DistributedOptimizer (SGD) on a model of 8 x 1 MiB weights, each
  rank's batch from seed (rank, step); writes, per step, the bucket cap and the number of
  buckets to <out>/rank<r>.json, the final weights to <out>/rank<r>.pt.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

import bagua_hvd.torch as hvd

WIDTH = 512  # 512 x 512 float32: 1 MiB per weight


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(8)])


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, WIDTH, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def tuning_over(step: int, broadcast) -> bool:
    """Every 10 steps: whether rank 0's tuner has ended (rank 0's answer, on every rank), so
    that a job runs until tuning ends however slow the machine, not a fixed number of steps."""
    if step % 10:
        return False
    from bagua_hvd.common import autotune

    active = autotune.rank0_bucket_state(0)[1] if hvd.rank() == 0 else True
    return not broadcast(active)


def run_ops(steps: int) -> dict:
    rank = hvd.rank()
    rng = random.Random(rank)
    tensors = [torch.full((256 + 64 * i,), float(rank + 1)) for i in range(24)]

    def bcast(active: bool) -> bool:
        return bool(hvd.broadcast(torch.tensor([int(active)]), 0, name="tuning")[0])

    for step in range(steps):
        if tuning_over(step, bcast):
            break
        if rank == 1:
            time.sleep(rng.uniform(0, 0.004))
        handles = [hvd.allreduce_async(t, name=f"t{i}", op=hvd.Sum) for i, t in enumerate(tensors)]
        for i, h in enumerate(handles):
            out = hvd.synchronize(h)
            total = hvd.size() * (hvd.size() + 1) / 2  # ranks contribute rank + 1
            assert torch.equal(out, torch.full_like(out, total)), (i, out[:4])
    return {}


def run_optimizer(steps: int, out: Path) -> dict:
    rank = hvd.rank()
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters()
    )
    caps = []
    extra = 5  # steps after tuning ended (the last bucket size planned and run)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, batch(rank, step)).backward()
        opt.step()
        caps.append([opt._bucket_cap, len(opt._buckets)])
        if not opt._tunes_buckets:  # agreed by every rank at the same step
            extra -= 1
            if extra == 0:
                break
    torch.save([p.detach() for p in model.parameters()], out / f"rank{rank}.pt")
    return {"caps": caps, "tuning": opt._tunes_buckets, "steps": len(caps)}


def run_tf_ops(steps: int) -> dict:
    """The ops mode through the TensorFlow frontend (its own hvd.init())."""
    import tensorflow as tf

    import bagua_hvd.tensorflow as hvd_tf

    hvd_tf.init()
    rank, size = hvd_tf.rank(), hvd_tf.size()
    rng = random.Random(rank)
    tensors = [tf.fill([256 + 64 * i], float(rank + 1)) for i in range(24)]
    total = size * (size + 1) / 2

    def bcast(active: bool) -> bool:
        return bool(hvd_tf.broadcast(tf.constant([int(active)]), 0, name="tuning")[0])

    for step in range(steps):
        if tuning_over(step, bcast):
            break
        if rank == 1:
            time.sleep(rng.uniform(0, 0.004))
        # Named: the same names at every step, which the autotuner's sampling counts.
        outs = hvd_tf.grouped_allreduce(tensors, op=hvd_tf.Sum, name="g")
        for i, out in enumerate(outs):
            assert bool(tf.reduce_all(out == total)), (i, out[:4])
    return {}


def main() -> None:
    mode, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if mode == "tf-ops":
        result = run_tf_ops(steps)
        (out / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
        print(f"rank {hvd.rank()} done", flush=True)
        return
    hvd.init()
    result = run_ops(steps) if mode == "ops" else run_optimizer(steps, out)
    (out / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
    print(f"rank {hvd.rank()} done", flush=True)


if __name__ == "__main__":
    main()
