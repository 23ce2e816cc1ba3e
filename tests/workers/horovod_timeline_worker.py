"""One rank of tests/test_horovod_timeline.py: runs the mode named by argv[1] under the real
launcher; the test reads the timeline file rank 0 wrote (HOROVOD_TIMELINE, or the path in
argv[2] for the dynamic modes)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import bagua_hvd.torch as hvd


def collectives() -> None:
    """Unfused allreduce, fused allreduces, allgather, broadcast, one DistributedOptimizer step."""
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    handles = [hvd.allreduce_async(torch.ones(4) * i, name=f"fused.{i}") for i in range(4)]
    for h in handles:
        hvd.synchronize(h)
    hvd.grouped_allreduce([torch.ones(5), torch.ones(6)], name="grouped")
    hvd.allgather(torch.ones(2, 3) * hvd.rank(), name="test_allgather")
    hvd.broadcast(torch.arange(4.0), root_rank=0, name="test_broadcast")
    hvd.allreduce(torch.ones(3), name="test_adasum", op=hvd.Adasum)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()


def main() -> None:
    mode = sys.argv[1]
    if mode == "errors":
        try:
            hvd.start_timeline("/nonexistent/never.json")
        except ValueError as e:
            print("BEFORE_INIT", e, flush=True)
        hvd.init()
        try:
            hvd.start_timeline("/tmp/never.json")
        except ValueError as e:
            print("NOT_ENABLED", e, flush=True)
        hvd.stop_timeline()  # as Horovod: stopping what does not run is no error
        print("STOPPED", flush=True)
        hvd.shutdown()
        return
    hvd.init()
    if mode == "env":
        collectives()
        # Horovod's test_timeline reads the file while the job runs: it is valid JSON already.
        time.sleep(0.2)
        if hvd.rank() == 0:
            with open(os.environ["HOROVOD_TIMELINE"]) as f:
                text = f.read()
            names = {e.get("args", {}).get("name") for e in json.loads(text)}
            print("LIVE", "allreduce.test_allreduce" in names, "CYCLE_START" in text, flush=True)
        hvd.allreduce(torch.ones(1), name="last")
    elif mode == "plain":
        hvd.allreduce(torch.ones(3), name="plain")
    elif mode == "dynamic":
        path = sys.argv[2]
        hvd.allreduce(torch.ones(3), name="before_start")
        hvd.start_timeline(path, mark_cycles=False)
        hvd.allreduce(torch.ones(3), name="between")
        hvd.allgather(torch.ones(2), name="between_gather")
        hvd.stop_timeline()
        hvd.allreduce(torch.ones(3), name="after_stop")
        hvd.stop_timeline()  # a second stop is a no-op
        # A second file through start again, with cycle markers.
        hvd.start_timeline(path + ".2", mark_cycles=True)
        hvd.allreduce(torch.ones(3), name="second_file")
        hvd.stop_timeline()
    hvd.shutdown()
    print("DONE", hvd.__name__, flush=True)


if __name__ == "__main__":
    main()
