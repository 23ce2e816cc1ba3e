"""Worker for tests/test_fault.py: a failure seen by one rank is named on a rank whose own wait
was on that one. Sets {0, 1} and {1, 2}: rank 1 runs an allreduce with rank 2 while rank 0 waits
for rank 1 in an allreduce of theirs. Rank 2 stops itself (SIGSTOP) once its request is out, so
that allreduce cannot end; argv[1] "stop" leaves it stopped (rank 1 times out on it), "kill" has
rank 0 SIGKILL it once rank 0 waits. Rank 1 sees it and exits at once, so what rank 0 sees is
rank 1's connection closing or rank 1 falling silent: its error must still name rank 2.

The order is made by the processes' states, not by sleeps racing the collectives: rank 1 and
rank 0 start only once rank 2 is stopped, and rank 0 a while after rank 1, so that the
coordinator orders rank 1's allreduce with rank 2 first and rank 1 times out first."""

import os
import signal
import sys
import threading
import time

import torch

import bagua_hvd.torch as hvd

mode = sys.argv[1]
a, b = hvd.ProcessSet([0, 1]), hvd.ProcessSet([1, 2])
hvd.init(process_sets=[a, b])
rank = hvd.rank()
hvd.allreduce(torch.ones(4), name="warm")  # every rank is up
pids = hvd.allgather_object(os.getpid())


def wait_until_stopped(pid: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    print(f"rank {rank}: rank 2 did not stop", flush=True)
    sys.exit(3)


start = time.monotonic()
try:
    if rank == 2:
        hvd.allreduce_async(torch.ones(4), name="b", process_set=b)
        time.sleep(0.5)  # the background thread sends the request (milliseconds)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif rank == 1:
        wait_until_stopped(pids[2])
        start = time.monotonic()
        hb = hvd.allreduce_async(torch.ones(4), name="b", process_set=b)
        ha = hvd.allreduce_async(torch.ones(4), name="a", process_set=a)
        hvd.synchronize(hb)
        hvd.synchronize(ha)
    else:
        wait_until_stopped(pids[2])
        time.sleep(0.5)  # "b" is negotiated before "a", and rank 1's wait began well before ours
        start = time.monotonic()
        if mode == "kill":
            threading.Timer(0.5, os.kill, (pids[2], signal.SIGKILL)).start()
        hvd.allreduce(torch.ones(4), name="a", process_set=a)
    print(f"rank {rank} NO ERROR", flush=True)
    sys.exit(2)
except hvd.HorovodInternalError as e:
    print(f"rank {rank} caught after {time.monotonic() - start:.2f} s: {e}", flush=True)
    if rank == 1:
        # Its exit closes its connections under rank 0, at once: the launcher stops the job 2 s
        # after rank 2's death ("kill"), and an interpreter's teardown under a sanitizer can take
        # that long. The runtime's thread is joined first (ThreadSanitizer checks it at exit).
        hvd.shutdown()
        os._exit(1)
    time.sleep(30)  # rank 0 stays until the launcher stops the job
