"""Elastic training on Ray with bagua_hvd.ray.ElasticRayExecutor (Horovod's
examples/ray/basic_ray_elastic.py, on scikit-learn's handwritten digits: CPU, no download).

    python examples/ray/elastic_digits.py                    # a local cluster that changes
    python examples/ray/elastic_digits.py --address auto     # a running cluster, as it is

Without --address the script starts a Ray cluster on this machine (a head without CPUs and two
nodes of one CPU: two workers), removes a node during epoch 2 and adds one during epoch 4: the
job shrinks to one worker, then grows back to two, without losing its place. Every worker runs
``train``: ``hvd.elastic.run`` with a ``TorchState`` (model, optimizer, ElasticSampler, epoch,
batch), a commit every few batches; rank 0 sends its progress to the driver through
``bagua_hvd.ray.ray_logger``, where the callbacks given to ``run`` print it (and change the
cluster). With ``import horovod.torch as hvd`` and ``from horovod.ray import ...`` it is a
Horovod script.
"""

from __future__ import annotations

import argparse
import threading
import time

import ray
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import bagua_hvd.torch as hvd
from bagua_hvd.ray import ElasticRayExecutor, ray_logger
from bagua_hvd.torch.elastic import ElasticSampler


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", help="a Ray cluster to join (default: start a local one)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05, help="per worker; scaled by hvd.size()")
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument(
        "--batch-delay",
        type=float,
        default=0.02,
        help="seconds of sleep per batch: a larger model's step, so that an epoch lasts long "
        "enough for the cluster's changes to land within the training",
    )
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=None)
    return parser.parse_args()


def train(args: argparse.Namespace) -> dict:
    """One worker: the elastic training loop. Returns the final metrics and weights' checksum."""
    torch.set_num_threads(1)
    hvd.init()
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    dataset = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    sampler = ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)

    def on_reset() -> None:
        # The learning rate follows the number of workers, as at the start.
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> float:
        loss = torch.tensor(0.0)
        while state.epoch < args.epochs:
            for data, target in loader:
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                time.sleep(args.batch_delay)
                sampler.record_batch(state.batch, args.batch_size)
                state.batch += 1
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                if hvd.rank() == 0:
                    ray_logger.log(
                        {"epoch": state.epoch, "batch": state.batch, "size": hvd.size(),
                         "loss": loss.item()}
                    )  # fmt: skip
            state.epoch += 1
            state.batch = 0
            sampler.set_epoch(state.epoch)
            state.commit()
        return hvd.allreduce(loss.detach(), name="final_loss").item()

    final_loss = loop(state)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    checksum = sum(p.double().sum().item() for p in model.parameters())
    return {"rank": hvd.rank(), "size": hvd.size(), "loss": final_loss,
            "accuracy": accuracy, "checksum": checksum}  # fmt: skip


class Progress:
    """Prints rank 0's progress once per epoch and size, and tells the main thread when epoch 2
    and epoch 4 begin (Ray's cluster changes must come from the main thread)."""

    def __init__(self) -> None:
        self.seen: set = set()
        self.epoch = {2: threading.Event(), 4: threading.Event()}

    def __call__(self, info: dict) -> None:
        key = (info["epoch"], info["size"])
        if key not in self.seen:
            self.seen.add(key)
            print(f"epoch {info['epoch']}: {info['size']} workers, loss {info['loss']:.3f}",
                  flush=True)  # fmt: skip
        if info["epoch"] in self.epoch:
            self.epoch[info["epoch"]].set()


def reached(event: threading.Event, job: threading.Thread) -> bool:
    """Waits for ``event`` while the job runs; False when the job ended first."""
    while job.is_alive():
        if event.wait(timeout=0.5):
            return True
    return False


def main() -> None:
    args = parse_args()
    cluster = None
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
    out: dict = {}
    try:
        settings = ElasticRayExecutor.create_settings(
            min_num_proc=args.min_workers, max_num_proc=args.max_workers, elastic_timeout=60
        )
        executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        executor.start()
        progress = Progress()

        def run() -> None:
            try:
                out["results"] = executor.run(lambda: train(args), callbacks=[progress])
            except BaseException as e:  # noqa: BLE001 - raised in the main thread below
                out["error"] = e

        job = threading.Thread(target=run)
        job.start()
        if cluster is not None:
            if reached(progress.epoch[2], job):
                print("removing a node", flush=True)
                cluster.remove_node(list(cluster.worker_nodes)[-1])
            if reached(progress.epoch[4], job):
                print("adding a node", flush=True)
                cluster.add_node(num_cpus=1)
        job.join()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    if "error" in out:
        raise out["error"]
    results = out["results"]
    for r in results:
        print(f"rank {r['rank']} of {r['size']}: loss {r['loss']:.4f}, "
              f"accuracy {r['accuracy']:.3f}, weights' sum {r['checksum']:.6f}")  # fmt: skip
    assert len({r["checksum"] for r in results}) == 1, "the workers' models differ"


if __name__ == "__main__":
    main()
