"""Worker for tests/test_ssh_hosts.py (ranks started over ssh in network namespaces).

    ssh_job.py check        prints where it runs; no process here shows the job's secret on
                            its command line; an allreduce against numpy
    ssh_job.py die RANK     RANK kills itself (SIGKILL) after a barrier; the others allreduce
                            until the job ends
    ssh_job.py wait         prints "ready" and sleeps (the launcher is signalled meanwhile)
"""

import os
import signal
import sys
import time

import numpy as np
import torch

import bagua_hvd.torch as hvd

mode = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
if mode == "check":
    secret = os.environ["BAGUA_HVD_SECRET"].encode()
    shown = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if secret in f.read():
                    shown.append(pid)
        except OSError:
            pass
    net = os.readlink("/proc/self/ns/net")
    print(f"rank {rank} host {os.environ['HOROVOD_HOSTNAME']} net {net} secret-shown {shown}",
          flush=True)
    data = [np.random.default_rng(r).standard_normal(100_000).astype(np.float32)
            for r in range(size)]
    out = hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="ssh.ar")
    np.testing.assert_allclose(out.numpy(), sum(data), rtol=1e-5, atol=1e-4)
    print(f"rank {rank} OK", flush=True)
elif mode == "die":
    victim = int(sys.argv[2])
    hvd.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1000)
    for i in range(100_000):  # bounded: the job ends long before
        hvd.allreduce(t, name=f"ssh.loop.{i % 4}")
        time.sleep(0.01)
elif mode == "wait":
    hvd.barrier()
    print(f"rank {rank} ready", flush=True)
    time.sleep(120)
