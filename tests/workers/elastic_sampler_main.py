"""An elastic torch job over an ElasticSampler (Horovod's pattern: the DataLoader is made anew at
each entry into the elastic function, ``record_batch`` after each step, ``set_epoch`` at the end
of an epoch). Each worker appends, once a batch is committed, ``epoch index...`` lines to
``--logdir/<start rank>``; ``--kill EPOCH,BATCH,START_RANK`` makes that worker SIGKILL itself
before that batch."""

from __future__ import annotations

import argparse
import os
import signal

import torch

import bagua_hvd.torch as hvd

p = argparse.ArgumentParser()
p.add_argument("--logdir", required=True)
p.add_argument("--samples", type=int, default=200)
p.add_argument("--batch-size", type=int, default=5)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--kill", default="")
args = p.parse_args()

start_rank = int(os.environ["HOROVOD_RANK"])
kill = tuple(int(v) for v in args.kill.split(",")) if args.kill else None
log = open(os.path.join(args.logdir, str(start_rank)), "a", buffering=1)

hvd.init()
torch.manual_seed(0)
model = torch.nn.Linear(1, 1)
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.001), named_parameters=model.named_parameters()
)
dataset = torch.utils.data.TensorDataset(torch.arange(args.samples, dtype=torch.float32))
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.batch_size, sampler=state.sampler
        )
        for idx, (x,) in enumerate(loader):
            if kill == (state.epoch, state.batch, start_rank):
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            model(x[:, None]).sum().backward()
            optimizer.step()
            state.sampler.record_batch(idx, args.batch_size)
            state.batch += 1
            state.save()  # commit() is save() then check_host_updates(): log in between
            log.write(f"{state.epoch} " + " ".join(str(int(v)) for v in x) + "\n")
            state.check_host_updates()
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.commit()


train(hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0))
