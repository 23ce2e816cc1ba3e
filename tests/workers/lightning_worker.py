"""One rank of tests/test_lightning.py's job (``bagua-run -np 2 python lightning_worker.py OUT``).

In one process (Lightning's import is the costly part), in this order:

1. ``collectives``: HorovodStrategy's reduce, all_gather (with sync_grads), broadcast, barrier,
   reduce_boolean_decision, ranks and sampler arguments against numbers computed here, and its
   argument errors;
2. ``decentralized``: a fit with ``Decentralized(peer_selection_mode="shift_one")`` on part of the
   digits, 2 epochs, a checkpoint per epoch through a CheckpointIO that prints who writes;
3. ``accumulate``: a fit with ``GradientAllReduce()`` and ``accumulate_grad_batches=2``;
4. ``accumulate_schedule``: the same with a GradientAccumulationScheduler (1, then 2 batches);
5. ``manual``: a fit with manual optimization (Horovod's allreduce);
6. ``pytorch_lightning``: a fit with the standalone pytorch_lightning package's Trainer and
   ``bagua_hvd.lightning.pytorch_lightning.HorovodStrategy`` (skipped without that package).

Fits 2 to 6 save, per rank, to OUT/<name>-rank<r>.pt: the weights when training started (after
the strategy's broadcast), every batch this rank trained on (with the samples' indices) and the
final weights; the test replays them through tests/reference_algorithms.py. Each part prints
"rank R: <name> ok".
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import bagua_hvd.torch as hvd
from bagua_hvd.lightning import HorovodStrategy
from bagua_hvd.torch import algorithms as A

SAMPLES = 192  # of the digits: 96 per rank
BATCH = 16
LR = 0.05  # per rank: the strategy scales it by the ranks
SAMPLER_SEED = 7  # L.seed_everything: DistributedSampler's seed
INIT_SEED = 100  # + rank: the replicas start different, the broadcast makes them equal


def data() -> TensorDataset:
    digits = load_digits()
    x = torch.from_numpy((digits.data[:SAMPLES] / 16.0).astype(np.float32))
    y = torch.from_numpy(digits.target[:SAMPLES].astype(np.int64))
    return TensorDataset(x, y, torch.arange(SAMPLES))


def make_net() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


def state(module: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def make_module(base: type) -> type:
    """A LightningModule class (of ``base``'s package) that records what it trains on."""

    class Recorder(base):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.batches: list = []
            self.initial: dict = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def on_train_start(self) -> None:
            self.initial = state(self.net)

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.batches.append((x.clone(), y.clone(), idx.clone()))
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(data(), batch_size=BATCH, shuffle=True)

    return Recorder


def make_manual_module(base: type) -> type:
    """The same with manual optimization: training_step steps the optimizer itself."""

    class Manual(make_module(base)):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y, idx = batch
            self.batches.append((x.clone(), y.clone(), idx.clone()))
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(F.cross_entropy(self(x), y))
            opt.step()

    return Manual


class PrintingCheckpointIO(TorchCheckpointIO):
    """Says which rank writes each checkpoint."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        print(f"rank {hvd.rank()} writes {os.path.basename(path)}", flush=True)
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


def trainer(strategy, trainer_cls=L.Trainer, **kwargs):
    return trainer_cls(
        strategy=strategy,
        accelerator="cpu",
        devices=kwargs.pop("devices", 1),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=kwargs.pop("enable_checkpointing", False),
        num_sanity_val_steps=0,
        **kwargs,
    )


def expect_error(what: str, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except ValueError as e:
        assert what in str(e), (what, str(e))
        return
    raise AssertionError(f"no ValueError ({what})")


def collectives() -> None:
    strategy = HorovodStrategy()
    t = trainer(strategy)
    r, n = hvd.rank(), hvd.size()
    s = t.strategy
    assert s is strategy and (t.world_size, t.global_rank) == (n, r), (t.world_size, t.global_rank)
    assert (s.world_size, s.global_rank, s.local_rank, s.node_rank) == (n, r, r, 0)
    assert s.is_global_zero == (r == 0) and s.is_distributed == (n > 1)
    assert s.root_device == torch.device("cpu"), s.root_device
    assert s.distributed_sampler_kwargs == {"num_replicas": n, "rank": r}
    from lightning_utilities.core.rank_zero import rank_zero_only

    assert rank_zero_only.rank == r

    x = torch.tensor([r + 1.0, 2.0 * r])
    assert s.reduce(x).tolist() == [(n + 1) / 2, n - 1.0]  # "mean" by default
    assert s.reduce(x, reduce_op="sum").tolist() == [n * (n + 1) / 2, n * (n - 1.0)]
    assert s.reduce(x, reduce_op=torch.distributed.ReduceOp.SUM).tolist() == [3.0, 2.0]
    assert s.reduce(x, reduce_op="max").tolist() == [float(n), 2.0 * (n - 1)]
    assert s.reduce(x, reduce_op="min").tolist() == [1.0, 0.0]
    assert x.tolist() == [r + 1.0, 2.0 * r]  # the input is left as it was
    ints = s.reduce(torch.tensor([3 * r + 1]))  # mean of 1 and 4: 2 (truncated, as DDP)
    assert ints.dtype == torch.int64 and ints.tolist() == [2], ints
    assert s.reduce("not a tensor") == "not a tensor"
    expect_error("unsupported reduce_op", s.reduce, x, reduce_op="bogus")
    expect_error("process groups", s.reduce, x, group=object())

    rows = s.all_gather(torch.full((2, 3), float(r)))
    assert rows.shape == (n, 2, 3) and all((rows[i] == i).all() for i in range(n)), rows
    assert s.all_gather(torch.tensor(float(r))).tolist() == [float(i) for i in range(n)]
    # sync_grads: rank q's loss weighs row i by (q + 1) * w[i]; each rank's input gets the sum
    # over ranks of its row's gradient: n (n + 1) / 2 * w[rank].
    mine = torch.tensor([1.0 + r, 2.0], requires_grad=True)
    w = torch.arange(2.0 * n).view(n, 2)
    (s.all_gather(mine, sync_grads=True) * w * (r + 1)).sum().backward()
    assert mine.grad.tolist() == (n * (n + 1) / 2 * w[r]).tolist(), mine.grad
    # LightningModule.all_gather passes torch.distributed.group.WORLD.
    assert s.all_gather(x, group=torch.distributed.group.WORLD).shape == (n, 2)
    expect_error("process groups", s.all_gather, x, group=object())

    value = {"from": 1, "items": [1, 2]} if r == 1 else None  # types differ between ranks
    assert s.broadcast(value, src=1) == {"from": 1, "items": [1, 2]}
    assert s.broadcast(f"rank {r}") == "rank 0"
    expect_error("not a rank", s.broadcast, 1, src=n)
    s.barrier("worker")
    assert s.reduce_boolean_decision(r == 0) is (n == 1)
    assert s.reduce_boolean_decision(r == 0, all=False) is True

    # Trainer(strategy="horovod") once bagua_hvd.lightning's strategy is imported. (Not built
    # here: for a name, Lightning first probes the cluster environments it knows, MPI's through
    # mpi4py, which this job's MPI need not load.)
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry.get("horovod"), HorovodStrategy)
    expect_error("no argument", HorovodStrategy, optimizer_kwargs={"compresion": None})
    expect_error("sets backward_passes_per_step", HorovodStrategy,
                 optimizer_kwargs={"backward_passes_per_step": 2})  # fmt: skip
    expect_error("takes an object of bagua_hvd.torch.algorithms", HorovodStrategy, "bytegrad")
    expect_error("use Trainer(devices=1)", trainer(HorovodStrategy(), devices=2).fit,
                 make_module(L.LightningModule)())  # fmt: skip
    print(f"rank {r}: collectives ok", flush=True)


def fit_and_save(name: str, out: str, strategy, base=L.LightningModule, trainer_cls=L.Trainer,
                 make=make_module, **kwargs) -> nn.Module:  # fmt: skip
    torch.manual_seed(INIT_SEED + hvd.rank())
    module = make(base)()
    trainer(strategy, trainer_cls, max_epochs=2, **kwargs).fit(module)
    record = {"initial": module.initial, "batches": module.batches, "final": state(module.net)}
    torch.save(record, os.path.join(out, f"{name}-rank{hvd.rank()}.pt"))
    return module


def main(out: str) -> int:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(SAMPLER_SEED, verbose=False)  # the same on every rank
    collectives()

    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(out, "checkpoints"), filename="{epoch}", save_top_k=-1
    )
    fit_and_save(
        "decentralized",
        out,
        HorovodStrategy(algorithm=A.Decentralized(peer_selection_mode="shift_one")),
        enable_checkpointing=True,
        callbacks=[checkpoints],
        plugins=[PrintingCheckpointIO()],
    )
    print(f"rank {hvd.rank()}: decentralized ok", flush=True)

    fit_and_save(
        "accumulate", out, HorovodStrategy(algorithm=A.GradientAllReduce()),
        accumulate_grad_batches=2,
    )  # fmt: skip
    print(f"rank {hvd.rank()}: accumulate ok", flush=True)

    # Epoch 1 one batch per step, epoch 2 two: the strategy follows the change.
    fit_and_save(
        "accumulate_schedule", out, HorovodStrategy(),
        callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})],
    )  # fmt: skip
    print(f"rank {hvd.rank()}: accumulate_schedule ok", flush=True)

    fit_and_save("manual", out, HorovodStrategy(), make=make_manual_module)
    print(f"rank {hvd.rank()}: manual ok", flush=True)

    try:
        import pytorch_lightning as pl
    except ImportError:
        print(f"rank {hvd.rank()}: pytorch_lightning skipped", flush=True)
        return 0
    from bagua_hvd.lightning.pytorch_lightning import HorovodStrategy as PLStrategy

    module = fit_and_save("pytorch_lightning", out, PLStrategy(), pl.LightningModule, pl.Trainer)
    assert isinstance(module.trainer.strategy, PLStrategy)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    rows = module.trainer.strategy.all_gather(flat)
    assert (rows == rows[0]).all(), "pytorch_lightning: the replicas differ"
    print(f"rank {hvd.rank()}: pytorch_lightning ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
