"""bagua-run --algorithm auto: a DistributedOptimizer built without algorithm= measures the
default candidates and keeps the faster; each rank prints its choice and its first step."""

from __future__ import annotations

import torch

import bagua_hvd.torch as hvd

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
steps = 2 + 2 * 2 * (3 + 1) + 2  # the default schedule, then two steps of the chosen candidate
for step in range(steps):
    opt.zero_grad()
    g = torch.Generator().manual_seed(100 * hvd.rank() + step)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
state = opt.state_dict()["bagua_hvd_auto"]
print(f"rank {hvd.rank()} chose {state['candidates'][state['chosen']]} at {state['chosen_step']}")
hvd.shutdown()
