"""Under mpirun: hvd.init(comm=...) on a part of MPI_COMM_WORLD (Horovod's global communicator).

``list``: world ranks 3, 1, 2 form the job (job rank = position in the list); world rank 0 is
not part of it: its init(comm=...) is refused, and it takes part in nothing. ``split``: an
mpi4py communicator per parity, so two jobs of two ranks run side by side.
"""

import sys

import torch
from mpi4py import MPI

import bagua_hvd.torch as hvd

mode = sys.argv[1]
world = MPI.COMM_WORLD.Get_rank()
if mode == "list":
    comm = [3, 1, 2]
    if world not in comm:
        try:
            hvd.init(comm=comm)
        except ValueError as e:
            print(f"REFUSED {world} {e}", flush=True)
        sys.exit(0)
else:
    comm = MPI.COMM_WORLD.Split(color=world % 2, key=world)
hvd.init(comm=comm)
total = hvd.allreduce(torch.tensor([float(world)]), op=hvd.Sum, name="sum")
members = hvd.allgather(torch.tensor([world]), name="members").tolist()
print(
    f"JOB {world} rank={hvd.rank()} size={hvd.size()} sum={total.item():g} members={members}",
    flush=True,
)
hvd.shutdown()
