"""Worker for tests/test_fault.py: a failure seen by one rank is named on a rank whose own wait
was on that one. Sets {0, 1} and {1, 2}: rank 1 runs an allreduce with rank 2 while rank 0 waits
for rank 1 in an allreduce of theirs; rank 2 then fails (argv[1]: "kill", SIGKILL; "stop",
SIGSTOP). Rank 1 sees it and exits at once, so what rank 0 sees is rank 1's connection closing
("kill") or rank 1 falling silent ("stop"): its error must still name rank 2."""

import os
import signal
import sys
import time

import torch

import bagua_hvd.torch as hvd

mode = sys.argv[1]
a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[a, b])
rank = hvd.rank()
hvd.allreduce(torch.ones(4), name="warm")  # every rank is up
# A payload whose allreduce lasts well past the signal (about 1 s over TCP here): rank 2 fails
# inside it.
big = torch.ones(64 << 20)
start = time.monotonic()
try:
    if rank == 2:
        hvd.allreduce_async(big, name="b", process_set=b)
        time.sleep(0.1)  # the request reaches the coordinator; the allreduce starts
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    elif rank == 1:
        hb = hvd.allreduce_async(big, name="b", process_set=b)
        ha = hvd.allreduce_async(torch.ones(4), name="a", process_set=a)
        hvd.synchronize(hb)
        hvd.synchronize(ha)
    else:
        # "a" is negotiated after "b", so rank 1 runs "b" first. "stop": rank 0's wait starts
        # after rank 1's last progress with rank 2, so rank 1 times out first.
        time.sleep(0.05 if mode == "kill" else 0.3)
        hvd.allreduce(torch.ones(4), name="a", process_set=a)
    print(f"rank {rank} NO ERROR", flush=True)
    sys.exit(2)
except hvd.HorovodInternalError as e:
    print(f"rank {rank} caught after {time.monotonic() - start:.2f} s: {e}", flush=True)
    if rank == 1:
        os._exit(1)  # at once: its connections close under rank 0
    time.sleep(30)  # rank 0 stays until the launcher stops the job
