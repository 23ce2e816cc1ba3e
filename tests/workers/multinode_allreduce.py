"""Worker for tests/test_multinode.py: prints the transport to every peer and checks an
allreduce, an allgather and a broadcast against numpy."""

import numpy as np
import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common._native import ffi, lib

hvd.init()
rank, size = hvd.rank(), hvd.size()
kinds = [ffi.string(lib().bhvd_transport_name(p)).decode() for p in range(size)]
print(
    f"rank {rank} node {hvd.cross_rank()} local {hvd.local_rank()} transports {kinds}", flush=True
)
rng = [np.random.default_rng(r).standard_normal(300_000).astype(np.float32) for r in range(size)]
out = hvd.allreduce(torch.from_numpy(rng[rank]), op=hvd.Sum, name="mn.ar")
np.testing.assert_allclose(out.numpy(), sum(rng), rtol=1e-5, atol=1e-4)
gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="mn.ag")
np.testing.assert_array_equal(
    gathered.numpy(), np.concatenate([np.full((r + 1, 2), float(r)) for r in range(size)])
)
b = hvd.broadcast(torch.from_numpy(rng[rank][:1000]), root_rank=size - 1, name="mn.bc")
np.testing.assert_array_equal(b.numpy(), rng[size - 1][:1000])
hvd.barrier()
print(f"rank {rank} OK", flush=True)
