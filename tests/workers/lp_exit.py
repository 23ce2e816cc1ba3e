"""Worker for tests/test_async_exit.py: trains with LowPrecisionDecentralized, whose ring exchange
runs in the background after each step, and leaves without waiting for it: by hvd.shutdown()
(argv[1] == "shutdown") or by falling off the end of the script (interpreter exit). Rank 1 is
slower: it sleeps before its last step, so rank 0 reaches the end while its last exchange still
waits for rank 1's."""

import sys
import time

import torch

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
for step in range(5):
    if rank == 1 and step == 4:
        time.sleep(1.0)
    opt.zero_grad()
    model(torch.randn(8, 64)).pow(2).mean().backward()
    opt.step()
print(f"rank {rank} done", flush=True)
start = time.monotonic()
if sys.argv[1] == "shutdown":
    hvd.shutdown()
    print(f"rank {rank} shutdown took {time.monotonic() - start:.2f} s", flush=True)
# "exit": nothing; the atexit handler shuts bagua_hvd down
