"""Worker for tests/test_multinode.py: init, a few steps of allreduces (as an optimizer enqueues
them: asynchronously, fused, checked against numpy), shutdown, again and again, with the
hierarchical allreduce on and off and the fusion threshold varied. The ranks finish a job's last
collective at different times; one that shuts down first must not fail a slower one still inside
that collective (core/farewell.cc)."""

import os
import sys

import numpy as np
import torch

import bagua_hvd.torch as hvd

cycles = int(sys.argv[1])
sizes = [1 << 18, 1 << 10, 1 << 19, 1 << 8, 1 << 17]
for c in range(cycles):
    os.environ["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1" if c % 2 == 0 else "0"
    os.environ["HOROVOD_FUSION_THRESHOLD"] = str([0, 4 << 20, 64 << 20][c % 3])
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for step in range(3):
        data = [[np.random.default_rng([c, step, i, r]).standard_normal(n).astype(np.float32)
                 for r in range(size)] for i, n in enumerate(sizes)]  # fmt: skip
        handles = [hvd.allreduce_async(torch.from_numpy(d[rank]), op=hvd.Average,
                                       name=f"c{c}.{i}") for i, d in enumerate(data)]  # fmt: skip
        for h, d in zip(handles, data):
            np.testing.assert_allclose(hvd.synchronize(h).numpy(), sum(d) / size, rtol=1e-5,
                                       atol=1e-5)  # fmt: skip
    hvd.shutdown()
print(f"rank {rank} cycles {cycles} OK", flush=True)
