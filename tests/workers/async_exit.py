"""Worker for tests/test_async_exit.py: trains with AsyncModelAverage and leaves WITHOUT calling
abort(): by hvd.shutdown() (argv[1] == "shutdown") or by falling off the end of the script
(interpreter exit). Rank 1 trains longer than rank 0, so rank 0 stops while rank 1's rounds
still run. Prints the merged rounds and the time the exit took."""

import sys
import time

import torch

import bagua_hvd.torch as hvd
from bagua_hvd.torch.algorithms import AsyncModelAverage

hvd.init()
rank = hvd.rank()
torch.manual_seed(0)
model = torch.nn.Linear(16, 4).to(torch.float16 if len(sys.argv) > 2 else torch.float32)
alg = AsyncModelAverage(sync_interval_ms=10)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.01),
    named_parameters=model.named_parameters(),
    algorithm=alg,
)
impl = opt._algo_impl
deadline = time.monotonic() + 20
steps = 0
while time.monotonic() < deadline and (impl.rounds() < 3 or steps < 20 + 30 * rank):
    opt.zero_grad()
    x = torch.randn(8, 16).to(model.weight.dtype)
    model(x).float().pow(2).mean().backward()
    opt.step()
    steps += 1
    time.sleep(0.005)
print(f"rank {rank} rounds {impl.rounds()} steps {steps}", flush=True)
start = time.monotonic()
if sys.argv[1] == "shutdown":
    hvd.shutdown()
    print(f"rank {rank} shutdown took {time.monotonic() - start:.2f} s", flush=True)
# "exit": nothing; the atexit handler shuts bagua_hvd down
