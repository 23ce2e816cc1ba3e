"""Worker for tests/test_strangers.py: a 2-rank job that starts while strangers hold connections
to rank 0's peer listener and to the rendezvous store.

Rank 0 prints its pid and starts hvd.init() at once (its listener opens); rank 1 waits for the
file $STRANGERS_READY (the test has connected its strangers by then), then initializes and
reports how long that took. Both check an allreduce against the formula.
"""

import os
import time

import torch

import bagua_hvd.torch as hvd

rank = int(os.environ["HOROVOD_RANK"])
print(f"pid={os.getpid()} store={os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}", flush=True)
if rank == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["STRANGERS_READY"]) and time.monotonic() < deadline:
        time.sleep(0.05)
start = time.monotonic()
hvd.init()
print(f"rank {rank} init took {time.monotonic() - start:.2f} s", flush=True)
x = torch.arange(10, dtype=torch.float64) * (rank + 1)
y = hvd.allreduce(x, op=hvd.Sum, name="x")
assert torch.equal(y, torch.arange(10, dtype=torch.float64) * 3), y  # (1 + 2) * arange
print(f"rank {rank} OK", flush=True)
