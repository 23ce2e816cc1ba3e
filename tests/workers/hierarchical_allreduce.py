"""Worker for tests/test_multinode.py: allreduces (one big tensor in place, fused small ones,
average with scale factors, a process set of one rank per host) checked against numpy, then
prints the bytes this rank sent to other hosts and the MPI calls its big allreduce made (under
HOROVOD_CPU_OPERATIONS=mpi)."""

import numpy as np
import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common._native import lib

hvd.init()
rank, size = hvd.rank(), hvd.size()
n = 1 << 20
data = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(size)]
hvd.allreduce(torch.ones(n), name="h.warm")  # the MPI engine creates its communicators here
before, calls = lib().bhvd_stat(b"bytes_sent_remote"), lib().bhvd_stat(b"mpi_calls")
out = hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="h.big")
np.testing.assert_allclose(out.numpy(), sum(data), rtol=1e-5, atol=1e-4)
sent = lib().bhvd_stat(b"bytes_sent_remote") - before
calls = lib().bhvd_stat(b"mpi_calls") - calls
small = [torch.full((5 + i,), float(rank + i)) for i in range(6)]
handles = [hvd.allreduce_async(t, op=hvd.Average, name=f"h.small.{i}") for i, t in enumerate(small)]
for i, h in enumerate(handles):
    expected = np.full(5 + i, np.mean([r + i for r in range(size)]), np.float32)
    np.testing.assert_allclose(hvd.synchronize(h).numpy(), expected, rtol=1e-6)
scaled = hvd.allreduce(torch.ones(1000) * (rank + 1), op=hvd.Average, prescale_factor=2.0,
                       postscale_factor=0.5, name="h.scaled")
np.testing.assert_allclose(scaled.numpy(), np.full(1000, np.mean(np.arange(1, size + 1))),
                           rtol=1e-6)
hvd.barrier()
where = f"{hvd.cross_rank()}/{hvd.cross_size()}"
print(f"rank {rank} of {size} on {where} mpi calls {calls}", flush=True)
print(f"rank {rank} remote bytes {sent} OK", flush=True)
