"""Data-parallel training of a small CNN on scikit-learn's handwritten digits with bagua_hvd.

Runs on CPU with no download (the 8x8 digits ship inside scikit-learn):

    bagua-run -np 2 python examples/pytorch/digits.py
    bagua-run -np 2 python examples/pytorch/digits.py --epochs 20 --resume   # continue

Without the launcher (`python examples/pytorch/digits.py`) it is a job of size 1. The script is
a Horovod script: replacing the import line with `import horovod.torch as hvd` runs it unchanged
under `horovodrun`. It shows the usual recipe:
  - the optimizer is wrapped in hvd.DistributedOptimizer, which averages gradients across ranks
    while backward() runs; the learning rate is scaled by hvd.size();
  - rank 0's parameters and optimizer state are broadcast (hvd.broadcast_parameters,
    hvd.broadcast_optimizer_state), so every replica starts equal, after a resume too;
  - each rank trains on its own shard; metrics are averaged (hvd.allreduce) or summed
    (op=hvd.Sum) across ranks and printed on rank 0, with a progress bar on rank 0 only;
  - rank 0 writes a checkpoint (model, optimizer, epoch) after every epoch; with --resume rank 0
    loads it and the epoch reaches the other ranks through hvd.broadcast_object;
  - at the end the replicas are compared through hvd.allgather: they must be identical.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import bagua_hvd.torch as hvd
from bagua_hvd.torch import algorithms as A

TEST_FRACTION = 0.2
DATA_SEED = 0  # the train/test split must be the same on every rank
DEFAULT_CHECKPOINT = os.path.join(tempfile.gettempdir(), "bagua_hvd_digits_checkpoint.pt")


# --algorithm: BAGUA's algorithms (docs/algorithms.md). Decentralized and asynchronous ones keep
# a different model on every rank; the others keep the replicas identical.
ALGORITHMS = {
    "gradient_allreduce": lambda opt, spe: A.GradientAllReduce(),
    "bytegrad": lambda opt, spe: A.ByteGrad(),
    "decentralized": lambda opt, spe: A.Decentralized(),
    "low_precision_decentralized": lambda opt, spe: A.LowPrecisionDecentralized(),
    "qadam": lambda opt, spe: A.QAdamAlgorithm(opt),
    # One epoch of gradient allreduce, then background averaging every 20 ms (an epoch here
    # lasts about a second).
    "async": lambda opt, spe: A.AsyncModelAverage(sync_interval_ms=20, warmup_steps=spe),
}
DIVERGING = {"decentralized", "low_precision_decentralized", "async"}
QADAM_LR_SCALE = 1 / 15  # Adam's step is not SGD's: 0.001 per rank for the default --lr


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15, help="total epochs (a resume included)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.015, help="per rank; scaled by hvd.size()")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup-epochs", type=float, default=3, help="lr warm-up (epochs)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--checkpoint",
        default=DEFAULT_CHECKPOINT,
        help="file rank 0 writes after every epoch and --resume reads; '' writes none "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from --checkpoint (rank 0 reads it)"
    )
    parser.add_argument(
        "--stop-after",
        type=int,
        default=0,
        metavar="EPOCH",
        help="stop after this epoch as if interrupted (the schedule still spans --epochs); "
        "continue later with --resume",
    )
    parser.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default=None,
        help="one of BAGUA's algorithms (default: BAGUA_HVD_ALGORITHM / bagua-run --algorithm, "
        "else Horovod's gradient allreduce); qadam swaps SGD for QAdamOptimizer",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on rank 0")
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit with status 1 if the final test accuracy is below this",
    )
    args = parser.parse_args(argv)
    if args.warmup_epochs < 0:
        parser.error(f"--warmup-epochs must be >= 0, got {args.warmup_epochs}")
    if not 0 <= args.stop_after <= args.epochs:
        parser.error(f"--stop-after must be in [0, --epochs], got {args.stop_after}")
    for name in ("epochs", "batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.resume and not args.checkpoint:
        parser.error("--resume needs a --checkpoint file")
    return args


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole data set as 1x8x8 images in [0, 1], split the same way on every rank."""
    digits = load_digits()
    x = torch.from_numpy((digits.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


class Net(nn.Module):
    """Two 3x3 convolutions, one 2x2 max-pool, two linear layers (~42k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def learning_rate(args: argparse.Namespace, epoch: float, size: int) -> float:
    """Horovod's recipe: the global batch grows with size(), so does the learning rate, reached
    through a linear warm-up from the 1-rank rate over the first --warmup-epochs (epoch counts
    from 0 and may be fractional); divided by 10 for the last third of the epochs."""
    if epoch < args.warmup_epochs:
        return args.lr * (1 + epoch * (size - 1) / args.warmup_epochs)
    return args.lr * size * (0.1 if epoch >= args.epochs * 2 // 3 else 1.0)


class Metric:
    """Running average of a per-rank value, averaged over ranks (as in Horovod's examples)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sum = torch.zeros((), dtype=torch.float64)
        self.n = 0

    def update(self, value: torch.Tensor) -> None:
        self.sum += hvd.allreduce(value.detach().to(torch.float64), name=self.name)
        self.n += 1

    @property
    def avg(self) -> float:
        return (self.sum / max(self.n, 1)).item()


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


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int
) -> None:
    """Rank 0 only. Written to a temporary file, then renamed: a crash leaves the old one."""
    state = {"epoch": epoch, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def restore(args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Collective. Rank 0 reads the checkpoint if asked; every rank gets its model, optimizer
    state and epoch. Returns the number of epochs already done, or -1 if rank 0 could not."""
    resume_from_epoch = 0
    if args.resume and hvd.rank() == 0:
        try:
            state = torch.load(args.checkpoint, map_location="cpu")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            resume_from_epoch = int(state["epoch"])
        except Exception as exc:  # whatever went wrong, the other ranks must hear of it
            print(f"cannot resume from {args.checkpoint}: {exc}", file=sys.stderr)
            resume_from_epoch = -1  # tells the other ranks to stop too, instead of hanging
    resume_from_epoch = hvd.broadcast_object(resume_from_epoch, root_rank=0, name="resume_epoch")
    if resume_from_epoch >= 0:
        # Resumed or fresh (the replicas were seeded differently): rank 0's state wins.
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return resume_from_epoch


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

    # Seeded per rank on purpose: the broadcast in restore() is what makes the replicas equal.
    torch.manual_seed(args.seed + rank)
    model = Net()
    lr_scale = QADAM_LR_SCALE if args.algorithm == "qadam" else 1.0
    if args.algorithm == "qadam":
        optimizer = A.QAdamOptimizer(
            model.parameters(), lr=lr_scale * learning_rate(args, 0, size),
            warmup_steps=2 * steps_per_epoch,
        )
    else:
        optimizer = torch.optim.SGD(
            model.parameters(), lr=learning_rate(args, 0, size), momentum=args.momentum
        )
    algorithm = ALGORITHMS[args.algorithm](optimizer, steps_per_epoch) if args.algorithm else None
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), algorithm=algorithm
    )
    done = restore(args, model, optimizer)
    if done < 0:
        return 1

    log(
        f"bagua_hvd digits: {size} rank(s), {len(x_train)} train samples on rank 0, "
        f"{steps_per_epoch} steps/epoch of {args.batch_size} per rank"
    )
    if done:
        log(f"resumed from epoch {done} ({args.checkpoint})")
    last = args.stop_after or args.epochs
    start = time.perf_counter()
    for epoch in range(done + 1, last + 1):
        # The shuffle depends on (seed, epoch, rank) only: a resumed run sees the same batches
        # as an uninterrupted one.
        order = torch.randperm(
            len(x_train), generator=torch.Generator().manual_seed(args.seed + 1000 * epoch + rank)
        )
        train_loss, train_acc = Metric("train.loss"), Metric("train.accuracy")
        with tqdm(
            total=steps_per_epoch,
            desc=f"epoch {epoch}/{args.epochs}",
            disable=rank != 0 or args.no_progress,
            leave=False,
            file=sys.stderr,
        ) as bar:
            for step in range(steps_per_epoch):
                idx = order[step * args.batch_size : (step + 1) * args.batch_size]
                for group in optimizer.param_groups:
                    group["lr"] = lr_scale * learning_rate(
                        args, epoch - 1 + step / steps_per_epoch, size
                    )
                optimizer.zero_grad()
                output = model(x_train[idx])
                loss = F.cross_entropy(output, y_train[idx])
                loss.backward()  # gradients are averaged across ranks while this runs
                optimizer.step()
                train_loss.update(loss)
                train_acc.update((output.argmax(dim=1) == y_train[idx]).float().mean())
                bar.set_postfix(
                    loss=f"{train_loss.avg:.4f}", accuracy=f"{train_acc.avg:.4f}", refresh=False
                )
                bar.update(1)
        test_loss, test_acc = evaluate(model, x_test, y_test)
        if rank == 0 and args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, epoch)
        log(
            f"epoch {epoch:3d}  train loss {train_loss.avg:.4f}  train accuracy "
            f"{train_acc.avg:.4f}  test loss {test_loss:.4f}  test accuracy {test_acc:.4f}"
        )
    elapsed = time.perf_counter() - start
    if isinstance(algorithm, A.AsyncModelAverage):
        algorithm.abort()  # no more background averaging: the models are final

    # The replicas must not have drifted apart: compare every rank's parameters with rank 0's.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(flat.unsqueeze(0), name="check.params")
    drift = (gathered - gathered[0]).abs().max().item()
    test_loss, test_acc = evaluate(model, x_test, y_test)
    samples = steps_per_epoch * args.batch_size * size * max(last - done, 0)
    log(
        f"trained epochs {done + 1}-{last} in {elapsed:.2f} s "
        f"({samples / max(elapsed, 1e-9):.0f} samples/s); "
        f"max parameter difference between replicas: {drift:.3g}"
    )
    if rank == 0 and args.checkpoint:
        log(f"checkpoint of epoch {max(last, done)}: {args.checkpoint}")
    log(f"final test loss: {test_loss:.6f}")
    log(f"final test accuracy: {test_acc:.4f}")
    diverging = (args.algorithm or os.environ.get(A.ALGORITHM_ENV, "")) in DIVERGING
    if not math.isfinite(drift) or (drift > 1e-5 and not diverging):
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
