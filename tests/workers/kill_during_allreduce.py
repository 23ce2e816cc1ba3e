"""Worker for tests/test_fault.py: rank 1 kills itself with SIGKILL while every rank is inside a
stream of allreduces; the survivors must raise HorovodInternalError naming rank 1."""

import os
import signal
import sys
import threading
import time

import torch

import bagua_hvd.torch as hvd

hvd.init()
rank = hvd.rank()
x = torch.ones(1 << 16)
for _ in range(20):  # warm up: the job works
    hvd.allreduce(x, name="warm", op=hvd.Sum)

if rank == 1:
    # Die from another thread while the main thread is blocked inside an allreduce.
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
start = time.monotonic()
try:
    for _ in range(1_000_000):
        hvd.allreduce(x, name="loop", op=hvd.Sum)
        if rank != 1 and time.monotonic() - start > 60:
            print("NO ERROR after 60 s", flush=True)
            sys.exit(2)
except hvd.HorovodInternalError as e:
    print(f"rank {rank} caught after {time.monotonic() - start:.2f} s: {e}", flush=True)
    # Stay alive until the launcher stops us: a survivor exiting first would itself become a
    # dead peer for the ranks that have not noticed rank 1 yet.
    time.sleep(30)
