"""PyTorch Lightning 2 on bagua_hvd: a small network trained on scikit-learn's digits by every rank
of a bagua_hvd job, through ``Trainer(strategy=HorovodStrategy(algorithm=...))``.

Runs on CPU with no download (the 8x8 digits ship inside scikit-learn):

    bagua-run -np 2 python examples/lightning/digits.py
    bagua-run -np 2 python examples/lightning/digits.py --algorithm decentralized
    bagua-run -np 2 python examples/lightning/digits.py --epochs 12 --resume CHECKPOINT.ckpt

Without the launcher (`python examples/lightning/digits.py`) it is a job of size 1. It shows:
  - the strategy: one Trainer per process with devices=1, the ranks started by bagua-run; the
    learning rate given per rank is scaled by the number of ranks, rank 0's weights reach every
    rank before the first step, and each rank trains on its part of the data (Lightning's
    DistributedSampler);
  - BAGUA's algorithms through --algorithm (HorovodStrategy(algorithm=...));
  - metrics logged with sync_dist=True (averaged over the ranks), a CSV log and the progress bar
    on rank 0 only, checkpoints written by rank 0 after every epoch and read by every rank on
    --resume (trainer.fit(ckpt_path=...) continues the epoch and step counters);
  - after training: the test accuracy over the whole test split (each rank evaluates its part,
    the counts are summed with trainer.strategy.reduce) and the largest difference between the
    ranks' weights (trainer.strategy.all_gather): 0 where gradients are averaged, not with the
    decentralized and asynchronous algorithms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bagua_hvd.lightning import HorovodStrategy
from bagua_hvd.torch import algorithms as A

TEST_FRACTION = 0.2
DATA_SEED = 0  # the train/test split must be the same on every rank
DEFAULT_OUTPUT = os.path.join(tempfile.gettempdir(), "bagua_hvd_lightning_digits")

# --algorithm: what HorovodStrategy(algorithm=...) gets. Decentralized and asynchronous
# algorithms keep a different model on every rank; the others keep the replicas identical.
ALGORITHMS = {
    "gradient_allreduce": lambda: A.GradientAllReduce(),
    "bytegrad": lambda: A.ByteGrad(),
    "decentralized": lambda: A.Decentralized(),
    "low_precision_decentralized": lambda: A.LowPrecisionDecentralized(),
    "async": lambda: A.AsyncModelAverage(sync_interval_ms=20, warmup_steps=20),
    "auto": lambda: "auto",
    # QAdam communicates for its own optimizer: a callable builds it for the one that
    # configure_optimizers returns (a QAdamOptimizer, see Digits.configure_optimizers).
    "qadam": lambda: lambda opt: A.QAdamAlgorithm(opt),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=6, help="total epochs (a resume included)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument(
        "--lr", type=float, default=0.05, help="per rank; HorovodStrategy scales it by the ranks"
    )
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument(
        "--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)"
    )
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--algorithm",
        choices=sorted(ALGORITHMS),
        default=None,
        help="one of BAGUA's algorithms (default: BAGUA_HVD_ALGORITHM / bagua-run --algorithm, "
        "else Horovod's gradient allreduce); qadam swaps SGD for QAdamOptimizer",
    )
    parser.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT,
        help="checkpoints/ and logs/ go here (rank 0 writes them; default %(default)s)",
    )
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--min-accuracy",
        type=float,
        default=0.0,
        help="exit with status 1 if the final test accuracy is below this",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "accumulate"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    return args


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole data set as 64 features in [0, 1], split the same way on every rank."""
    digits = load_digits()
    x = torch.from_numpy((digits.data / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(DATA_SEED))
    n_test = int(len(x) * TEST_FRACTION)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


class Digits(L.LightningModule):
    """A two-layer perceptron (64 -> 128 -> 10) with SGD (or QAdam)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        self.x_train, self.y_train, self.x_test, self.y_test = load_split()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        # Epoch averages over every rank's batches (HorovodStrategy.reduce).
        self.log_dict(
            {"train_loss": loss, "train_accuracy": accuracy},
            on_step=False,
            on_epoch=True,
            sync_dist=True,
        )
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        self.log_dict(
            {"val_loss": F.cross_entropy(logits, y), "val_accuracy": accuracy}, sync_dist=True
        )

    def on_train_start(self) -> None:
        if self.trainer.is_global_zero:
            print(
                f"starting at epoch {self.current_epoch + 1} (global step {self.global_step}) "
                f"on {self.trainer.world_size} rank(s)",
                flush=True,
            )

    def on_train_epoch_end(self) -> None:
        # After this epoch's validation; the metrics are averages over every rank.
        m = self.trainer.callback_metrics
        if self.trainer.is_global_zero:
            print(
                f"epoch {self.current_epoch + 1:3d}  train loss {m['train_loss']:.4f}  "
                f"train accuracy {m['train_accuracy']:.4f}  val loss {m['val_loss']:.4f}  "
                f"val accuracy {m['val_accuracy']:.4f}",
                flush=True,
            )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # The learning rate per rank: HorovodStrategy multiplies it by the number of ranks.
        if self.args.algorithm == "qadam":
            return A.QAdamOptimizer(self.parameters(), lr=self.args.lr / 15, warmup_steps=40)
        return torch.optim.SGD(self.parameters(), lr=self.args.lr, momentum=self.args.momentum)

    def train_dataloader(self) -> DataLoader:
        # Lightning puts in a DistributedSampler (HorovodStrategy's ranks): each rank its part.
        return DataLoader(
            TensorDataset(self.x_train, self.y_train), batch_size=self.args.batch_size, shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x_test, self.y_test), batch_size=256)


def evaluate(trainer: L.Trainer, model: Digits) -> tuple[float, float]:
    """(loss, accuracy) over the whole test split: each rank its part, the sums reduced."""
    rank, size = trainer.global_rank, trainer.world_size
    x, y = model.x_test[rank::size], model.y_test[rank::size]
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
    total = trainer.strategy.reduce(stats, reduce_op="sum")
    return (total[0] / total[2]).item(), (total[1] / total[2]).item()


def replica_difference(trainer: L.Trainer, model: Digits) -> float:
    """The largest difference between any rank's weights and rank 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # (ranks, parameters); at one rank all_gather returns its input as it is
    gathered = trainer.strategy.all_gather(flat).view(trainer.world_size, -1)
    return (gathered - gathered[0]).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # one rank per core
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # small data in memory
    L.seed_everything(args.seed, verbose=False)  # the same on every rank: so is the sampler's
    algorithm = ALGORITHMS[args.algorithm]() if args.algorithm else None
    strategy = HorovodStrategy(algorithm=algorithm)  # hvd.init(): the ranks are known from here
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(args.output_dir, "checkpoints"),
        filename="digits-{epoch}",
        save_top_k=-1,  # one per epoch
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,  # per process: bagua-run starts the processes
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        callbacks=[checkpoints],
        logger=CSVLogger(os.path.join(args.output_dir, "logs"), name="digits"),
        log_every_n_steps=10,
        enable_progress_bar=not args.no_progress,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = Digits(args)
    trainer.fit(model, ckpt_path=args.resume)

    test_loss, test_accuracy = evaluate(trainer, model)
    difference = replica_difference(trainer, model)
    if trainer.is_global_zero:
        print(f"trained to epoch {trainer.current_epoch} (global step {trainer.global_step})")
        print(f"checkpoints: {checkpoints.dirpath}")
        print(f"max parameter difference between replicas: {difference:.3g}")
        print(f"final test loss: {test_loss:.6f}")
        print(f"final test accuracy: {test_accuracy:.4f}", flush=True)
    if test_accuracy < args.min_accuracy:
        print(
            f"final test accuracy {test_accuracy:.4f} is below --min-accuracy {args.min_accuracy}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
