"""Data-parallel training of a small MLP on scikit-learn's handwritten digits with bagua_hvd.

Runs on CPU with no download (the 8x8 digits ship inside scikit-learn):

    bagua-run -np 2 python examples/pytorch/pytorch_digits.py

Without the launcher (`python examples/pytorch/pytorch_digits.py`) it is a job of size 1.
The collectives are Horovod's, so replacing the import line with `import horovod.torch as hvd`
runs the same script under `horovodrun`:
  - parameters are broadcast from rank 0 (hvd.broadcast_) so that every replica starts equal;
  - each rank trains on its own shard and averages gradients with hvd.grouped_allreduce_ before
    optimizer.step() (DistributedOptimizer does this for you; it comes in a later release);
  - metrics are averaged (hvd.allreduce) or summed (op=hvd.Sum) across ranks, printed on rank 0;
  - at the end the replicas are compared through hvd.allgather: they must be identical.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import bagua_hvd.torch as hvd

TEST_FRACTION = 0.2
DATA_SEED = 0  # the train/test split must be the same on every rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05, help="per rank; scaled by hvd.size()")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit with status 1 if the final test accuracy is below this",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole data set, split the same way on every rank (features scaled to [0, 1])."""
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, hidden * 2),
        nn.ReLU(),
        nn.Linear(hidden * 2, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Global (loss, accuracy) over all ranks' shards: sums of counts, so shards may differ."""
    model.eval()
    with torch.no_grad():
        logits = model(x)
        stats = torch.tensor(
            [
                F.cross_entropy(logits, y, reduction="sum").item(),
                (logits.argmax(dim=1) == y).sum().item(),
                float(len(y)),
            ],
            dtype=torch.float64,
        )
    model.train()
    total = hvd.allreduce(stats, name="eval.stats", op=hvd.Sum)
    return total[0].item() / total[2].item(), total[1].item() / total[2].item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one rank per core
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    log = print if rank == 0 else (lambda *a, **k: None)

    x_train, y_train, x_test, y_test = load_split()
    # Every rank computes the same step count from global sizes, so all ranks issue the same
    # number of collectives even when the shards differ by one sample.
    steps_per_epoch = max(1, (len(x_train) // size) // args.batch_size)
    x_train, y_train = x_train[rank::size], y_train[rank::size]
    x_test, y_test = x_test[rank::size], y_test[rank::size]

    # Seeded per rank on purpose: the broadcast below is what makes the replicas equal.
    torch.manual_seed(args.seed + rank)
    model = make_model(args.hidden)
    for name, tensor in model.state_dict().items():
        hvd.broadcast_(tensor, root_rank=0, name=f"init.{name}")
    params = [p for p in model.parameters() if p.requires_grad]
    # Horovod's rule of thumb: the global batch grows with size(), so does the learning rate.
    optimizer = torch.optim.SGD(params, lr=args.lr * size, momentum=args.momentum)

    log(
        f"bagua_hvd digits: {size} rank(s), {len(x_train)} train samples on rank 0, "
        f"{steps_per_epoch} steps/epoch of {args.batch_size} per rank"
    )
    shuffle = torch.Generator().manual_seed(args.seed + 1000 + rank)
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x_train), generator=shuffle)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for step in range(steps_per_epoch):
            idx = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            # One fused request for all gradients; in place, averaged over ranks.
            hvd.grouped_allreduce_([p.grad for p in params], name="grads", op=hvd.Average)
            optimizer.step()
            loss_sum += loss.item()
        train_loss = hvd.allreduce(loss_sum / steps_per_epoch, name="train.loss").item()
        test_loss, test_acc = evaluate(model, x_test, y_test)
        log(
            f"epoch {epoch:3d}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_acc:.4f}"
        )
    elapsed = time.perf_counter() - start

    # The replicas must not have drifted apart: compare every rank's parameters with rank 0's.
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    gathered = hvd.allgather(flat.unsqueeze(0), name="check.params")
    drift = (gathered - gathered[0]).abs().max().item()
    _, test_acc = evaluate(model, x_test, y_test)
    samples = steps_per_epoch * args.batch_size * size * args.epochs
    log(
        f"trained {args.epochs} epochs in {elapsed:.2f} s ({samples / elapsed:.0f} samples/s); "
        f"max parameter difference between replicas: {drift:.3g}"
    )
    log(f"final test accuracy: {test_acc:.4f}")
    if not math.isfinite(drift) or drift > 1e-5:
        print(f"rank {rank}: replicas diverged (max difference {drift:.3g})", file=sys.stderr)
        return 1
    if test_acc < args.min_accuracy:
        log(
            f"final test accuracy {test_acc:.4f} is below --min-accuracy {args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
