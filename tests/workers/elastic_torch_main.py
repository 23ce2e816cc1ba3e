"""An elastic torch training run as Horovod's elastic integration tests drive it (the same
arguments and log lines as Horovod's test/integration/data/elastic_torch_main.py, written anew).

Rank 0 appends one JSON line per epoch to --logfile: epoch, batch, commits, hostname,
start_rank (HOROVOD_RANK at process start), rank, size, rendezvous (entries into the elastic
function), the size each of the epoch's batches ran at, and the model's parameters. --exit-schedule '{"(1, 0)": [0]}' makes the
workers whose start rank is listed fail at (epoch, batch): by exception or by SIGKILL
(--exit-mode). When --discovery-schedule says the hosts change after an epoch, rank 0 waits
(up to --discovery-wait s) for the driver's notification before committing the epoch, so the
change takes effect at that commit.

With ``algorithm="auto"`` (BAGUA_HVD_ALGORITHM=auto, or --auto-decentralized), every rank
appends one JSON line per epoch to --logfile.auto.RANK: the candidate and whether it was final
at each of the epoch's steps, its schedule's step count, choice and number of measured steps,
the steps of the candidate's implementation, and the model's parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
from elastic_common import wait_for_host_update

import bagua_hvd.torch as hvd

p = argparse.ArgumentParser()
p.add_argument("--logfile", required=True)
p.add_argument("--discovery-schedule", default="[]")
p.add_argument("--exit-schedule", default="{}")
p.add_argument("--exit-mode", choices=("exception", "kill"), default="exception")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--batches-per-epoch", type=int, default=10)
p.add_argument("--batches-per-commit", type=int, default=1)
p.add_argument("--epoch-wait", type=float, default=0.0)
p.add_argument("--discovery-wait", type=float, default=10.0)
# "E,N": at the end of epoch E, rank 0 waits (up to --discovery-wait s) for a host update
# unless the job already has N ranks: a host coming back takes effect by then, whatever the load.
p.add_argument("--expect-size", default="")
# algorithm=Auto([GradientAllReduce(), Decentralized(shift_one, every 2 steps, flat)]) instead of
# the environment's algorithm.
p.add_argument("--auto-decentralized", action="store_true")
args = p.parse_args()

start_rank = int(os.environ["HOROVOD_RANK"])
hostname = os.environ["HOROVOD_HOSTNAME"]
schedule = {e: hosts for e, hosts in json.loads(args.discovery_schedule)}
exits = {k: v for k, v in json.loads(args.exit_schedule).items()}

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
lr = 0.01
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
algorithm = None  # BAGUA_HVD_ALGORITHM's
if args.auto_decentralized:
    from bagua_hvd.torch import algorithms as A

    decentralized = A.Decentralized(
        hierarchical=False, peer_selection_mode="shift_one", communication_interval=2
    )
    algorithm = A.Auto([A.GradientAllReduce(), decentralized])
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), algorithm=algorithm
)


def settled_count(path: str) -> int:
    """Entries of ``path`` (this process's threads or descriptors), the fewest of a few looks
    50 ms apart: one opened and closed in passing (a connection being set up or torn down) is
    not held, and a leak shows in every look. Seen once: 12 descriptors at the first epoch, 11
    at the last (CI, 2026-12-06)."""
    counts = []
    for _ in range(5):
        counts.append(len(os.listdir(path)))
        time.sleep(0.05)
    return min(counts)


def hosts_for(epoch: int):
    return schedule.get(epoch, schedule.get(None))


def check_exit(epoch: int, batch: int) -> None:
    if start_rank in exits.get(str((epoch, batch)), []):
        if args.exit_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(
            f"check_rank and exit epoch={epoch} batch={batch} start_rank={start_rank} "
            f"rank={hvd.rank()}"
        )


# algorithm="auto": (candidate, final) of each step since the epoch began, this process's.
auto_steps: list = []


def auto_epoch_line(epoch: int) -> None:
    """algorithm="auto": this rank's steps of the epoch and its schedule, for the test."""
    schedule = getattr(optimizer._algo_impl, "schedule", None)
    if schedule is None:
        return
    line = {
        "epoch": epoch, "rank": hvd.rank(), "size": hvd.size(), "start_rank": start_rank,
        "steps": list(auto_steps), "step": schedule.step, "chosen": schedule.chosen,
        "chosen_step": schedule.chosen_step, "measured": schedule.measured,
        # The steps of the candidate's implementation (None: Horovod's allreduce).
        "impl_step": getattr(optimizer._algo_impl.impl, "step", None),
        "params": [float(v) for p in model.parameters() for v in p.detach().flatten()],
    }  # fmt: skip
    with open(f"{args.logfile}.auto.{hvd.rank()}", "a") as f:
        f.write(json.dumps(line) + "\n")
    auto_steps.clear()


def averager_rounds() -> int:
    """Rounds the asynchronous averager of the optimizer's algorithm merged (0: none runs)."""
    averaging = getattr(optimizer._algo_impl, "averaging", None)
    rounds = getattr(averaging, "rounds", None)
    return rounds() if rounds is not None else 0


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        while state.batch < args.batches_per_epoch:
            check_exit(state.epoch, state.batch)
            # Each rank's sample depends on its current rank and the global batch number only,
            # so that the test can replay the training from the sizes the batches ran at.
            g = torch.Generator().manual_seed(
                100000 * hvd.rank() + 1000 * state.epoch + state.batch
            )
            x = torch.randn(8, 4, generator=g)
            y = x.sum(dim=1, keepdim=True)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if hasattr(optimizer._algo_impl, "schedule"):
                auto_steps.append(optimizer._algo_impl._key)
            state.sizes = state.sizes + (hvd.size(),)  # a tuple: commit() keeps a copy
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commits += 1
                state.commit()
        auto_epoch_line(state.epoch)
        impl = optimizer._algo_impl
        # (Auto's implementation has no averaging of its own.)
        if hasattr(getattr(impl, "averaging", None), "pending"):
            # Low-precision decentralized: each rank's replicas (self, left, right) after the
            # epoch's exchanges, for the test to check them against its ring neighbours'.
            impl.flush()
            digests = [[hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16] for t in reps]
                       for reps in impl.replicas or []]  # fmt: skip
            with open(f"{args.logfile}.replicas.{hvd.rank()}", "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "size": hvd.size(),
                                    "replicas": digests}) + "\n")  # fmt: skip
        if hvd.rank() == 0:
            line = {
                "epoch": state.epoch,
                "batch": state.batch,
                "commits": state.commits,
                "hostname": hostname,
                "start_rank": start_rank,
                "rank": hvd.rank(),
                "size": hvd.size(),
                "rendezvous": state.rendezvous,
                "sizes": list(state.sizes),
                # What the process holds: resets must not leak threads or descriptors.
                "threads": settled_count("/proc/self/task"),
                "fds": settled_count("/proc/self/fd"),
                "params": [float(v) for p in model.parameters() for v in p.detach().flatten()],
                # Asynchronous averaging: rounds the current averager merged (since the reset).
                "rounds": averager_rounds(),
            }
            with open(args.logfile, "a") as f:
                f.write(json.dumps(line) + "\n")
            expect = (
                tuple(int(v) for v in args.expect_size.split(",")) if args.expect_size else None
            )
            awaited = expect is not None and expect[0] == state.epoch and hvd.size() < expect[1]
            if awaited or hosts_for(state.epoch + 1) != hosts_for(state.epoch):
                wait_for_host_update(state, args.discovery_wait)
        if args.epoch_wait:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.sizes = ()
        state.commits += 1
        state.commit()


def on_reset():
    for group in optimizer.param_groups:
        group["lr"] = lr * hvd.size()


state = hvd.elastic.TorchState(
    model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0, sizes=()
)
state.register_reset_callbacks([on_reset])
train(state)
