"""Prints this rank's job id after an allreduce across every rank (the peers' HELLOs carry the
job id, so the allreduce completes only where every rank has the same one)."""

import os

import torch

import bagua_hvd.torch as hvd

hvd.init()
out = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="job_id_check")
assert out.item() == hvd.size(), out
print(f"rank {hvd.rank()} job {os.environ['BAGUA_HVD_JOB_ID']}", flush=True)
hvd.shutdown()
