"""A Horovod user's PyTorch script, as written for Horovod: it imports ``horovod.torch`` and
nothing of bagua_hvd (tests/test_as_horovod.py runs it with BAGUA_HVD_AS_HOROVOD, and a copy
with the import line rewritten to bagua_hvd). Each rank prints one ``RESULT {json}`` line: the
weights after a few steps of hvd.DistributedOptimizer and an allreduce's sum."""

import json

import horovod
import horovod.torch as hvd
import torch

hvd.init()
torch.manual_seed(hvd.rank())  # the replicas start different: the broadcast makes them equal
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
start = [p.detach().clone() for p in model.parameters()]

data = torch.Generator().manual_seed(100 + hvd.rank())  # each rank its own data
x = torch.randn(16, 4, generator=data)
y = x.sum(dim=1, keepdim=True)
for _ in range(5):
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()

total = hvd.allreduce(torch.arange(4.0) * (hvd.rank() + 1), op=hvd.Sum, name="total")
result = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "version": horovod.__version__,
    "module": hvd.__name__,
    "start": [p.tolist() for p in start],
    "x": x.tolist(),
    "y": y.tolist(),
    "weights": [p.detach().tolist() for p in model.parameters()],
    "total": total.tolist(),
}
print("RESULT " + json.dumps(result), flush=True)
