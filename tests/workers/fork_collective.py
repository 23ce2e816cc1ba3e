"""A DataLoader worker (a forked child) whose dataset calls hvd.allreduce gets a clear error at
once instead of waiting forever, and the parent's job goes on. Prints "fork ok" per rank."""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import bagua_hvd.torch as hvd


class Reducing(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        return hvd.allreduce(torch.ones(1), name=f"in_worker_{i}")


hvd.init()
rank = hvd.rank()
loader = DataLoader(Reducing(), num_workers=1, multiprocessing_context="fork", timeout=30)
start = time.monotonic()
try:
    next(iter(loader))
except RuntimeError as e:
    took = time.monotonic() - start
    assert "was forked from process" in str(e) and "hvd.init()" in str(e), e
    assert took < 20, f"the error took {took:.1f} s"
else:
    raise SystemExit("the allreduce in a forked DataLoader worker did not raise")
# The parent's job is intact: a collective completes with every rank.
out = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, name="after_fork")
assert out.item() == sum(range(hvd.size())), out
print(f"rank {rank}: fork ok", flush=True)
hvd.shutdown()
