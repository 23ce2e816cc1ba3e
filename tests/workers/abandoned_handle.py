"""Rank 0 starts an in-place allreduce that rank 1 never joins, then both shut down: waiting on
the abandoned handle must raise HorovodInternalError naming the shutdown (Horovod's handle map),
not return None with the tensor unreduced. Prints "abandoned ok" on rank 0 on success."""

import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common.exceptions import HorovodInternalError

hvd.init()
rank = hvd.rank()
t = torch.ones(4)
if rank == 0:
    handle = hvd.allreduce_async_(t, name="never_joined")
hvd.barrier()  # rank 0's op is queued (and cannot complete) before anyone shuts down
hvd.shutdown()
if rank == 0:
    try:
        result = hvd.synchronize(handle)
    except HorovodInternalError as e:
        assert "Horovod has been shut down" in str(e), e
        assert torch.equal(t, torch.ones(4)), t
        print("abandoned ok", flush=True)
    else:
        raise SystemExit(f"synchronize returned {result!r} for an op shutdown abandoned")
