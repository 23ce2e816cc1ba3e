"""Worker for tests/test_async_exit.py: trains with LowPrecisionDecentralized, whose ring exchange
runs in the background after each step, and leaves without waiting for it: by hvd.shutdown()
(argv[1] == "shutdown") or by falling off the end of the script (interpreter exit); with
argv[1] == "stall", rank 1 never takes its last step until rank 0 has shut down. Rank 1 is
slower: it takes its last step only once rank 0 has reached the end of the script (a marker
file, $LP_EXIT_MARKER), so rank 0 always ends while its last exchange still waits for rank 1's."""

import os
import sys
import time
from pathlib import Path

import torch
from marker import wait_for  # tests/workers/marker.py

import bagua_hvd.torch as hvd
from bagua_hvd.torch.algorithms import LowPrecisionDecentralized

hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Linear(64, 32)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters(),
    algorithm=LowPrecisionDecentralized(),
)
marker = Path(os.environ["LP_EXIT_MARKER"])
stall = sys.argv[1] == "stall"
for step in range(5):
    if rank == 1 and step == 4 and stall:
        # Never takes its last step while rank 0 shuts down: rank 0's wait for its last
        # exchange must end by itself (HOROVOD_GLOO_TIMEOUT_SECONDS).
        wait_for(marker.with_suffix(".shut"), "rank 1", "rank 0's shutdown", timeout=120)
        break
    if rank == 1 and step == 4:
        wait_for(marker, "rank 1", "rank 0 reaching the end of the script")
        time.sleep(0.3)  # rank 0 is now in shutdown (or exit), its last exchange in flight
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
print(f"rank {rank} done", flush=True)
if rank == 0:
    marker.touch()  # rank 1 takes its last step only now
start = time.monotonic()
if sys.argv[1] in ("shutdown", "stall"):
    hvd.shutdown()
    print(f"rank {rank} shutdown took {time.monotonic() - start:.2f} s", flush=True)
    if rank == 0 and stall:
        marker.with_suffix(".shut").touch()
# "exit": nothing; the atexit handler shuts bagua_hvd down
