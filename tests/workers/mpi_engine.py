"""Worker for tests/test_mpi_ops.py, started by mpirun with HOROVOD_CPU_OPERATIONS=mpi: every
collective against numpy, and which data path carried it (the core's counters: MPI calls made,
payload bytes the core's own transports sent)."""

import numpy as np
import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common._native import lib

hvd.init(process_sets="dynamic")
rank, size = hvd.rank(), hvd.size()
from mpi4py import MPI  # noqa: E402  (the MPI hvd.init() formed the job through)

print(f"rank {rank} mpi_enabled {hvd.mpi_enabled()} threads {hvd.mpi_threads_supported()} "
      f"library {MPI.Get_library_version().splitlines()[0]}", flush=True)  # fmt: skip


def counters():
    return lib().bhvd_stat(b"mpi_calls"), lib().bhvd_stat(b"bytes_sent")


def data(r, n, dtype, seed=0):
    rng = np.random.default_rng(1000 * seed + r)
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(n).astype(dtype)
    return rng.integers(-50, 50, n).astype(dtype)


# Allreduce through MPI: every dtype MPI reduces, each op, against numpy; the core's own
# transports send nothing.
calls, sent = counters()
REDUCE = {hvd.Sum: lambda xs: np.sum(xs, axis=0), hvd.Min: lambda xs: np.min(xs, axis=0),
          hvd.Max: lambda xs: np.max(xs, axis=0), hvd.Product: lambda xs: np.prod(xs, axis=0)}  # fmt: skip
NARROW = (np.int16, np.int8, np.uint8)  # their sums go over the core's transports
for i, dtype in enumerate([np.float32, np.float64, np.int32, np.int64, *NARROW]):
    for op, ref in REDUCE.items():
        if dtype in NARROW and op == hvd.Sum:
            continue
        n = 1000 + 37 * i
        xs = [data(r, n, dtype, seed=i) for r in range(size)]
        if op == hvd.Product:
            xs = [np.sign(x) + (x == 0) for x in xs]  # +-1: no overflow
        out = hvd.allreduce(torch.from_numpy(xs[rank]), op=op, name=f"ar.{i}.{op}")
        expected = ref(np.stack(xs)).astype(dtype)
        if np.issubdtype(dtype, np.floating):
            np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(out.numpy(), expected)
# Average with pre/postscale, fused (grouped) and one large tensor (in place, not fused).
xs = [data(r, 3_000_000, np.float32, seed=9) for r in range(size)]
out = hvd.allreduce(torch.from_numpy(xs[rank]), name="ar.big")
np.testing.assert_allclose(out.numpy(), np.mean(xs, axis=0), rtol=1e-5, atol=1e-5)
group = [torch.from_numpy(data(rank, n, np.float64, seed=n)) for n in (1, 10, 100)]
outs = hvd.grouped_allreduce(group, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
for n, o in zip((1, 10, 100), outs):
    ref = 1.5 * np.sum([data(r, n, np.float64, seed=n) for r in range(size)], axis=0)
    np.testing.assert_allclose(o.numpy(), ref, rtol=1e-12)
# Allgather (rows differ per rank), broadcast, alltoall (uneven splits), reducescatter.
g = hvd.allgather(torch.full((rank + 1, 3), rank, dtype=torch.int64), name="ag")
np.testing.assert_array_equal(
    g.numpy(), np.concatenate([np.full((r + 1, 3), r) for r in range(size)])
)
b = hvd.broadcast(torch.from_numpy(data(rank, 5000, np.float32, seed=3)), root_rank=size - 1)
np.testing.assert_array_equal(b.numpy(), data(size - 1, 5000, np.float32, seed=3))
splits = [(rank + k) % 3 + 1 for k in range(size)]
rows = torch.arange(sum(splits), dtype=torch.float32) + 1000 * rank
got, rsplits = hvd.alltoall(rows, splits=splits)
expected = []
for src in range(size):
    their = [(src + k) % 3 + 1 for k in range(size)]
    start = sum(their[:rank])
    expected += list(np.arange(start, start + their[rank]) + 1000 * src)
np.testing.assert_array_equal(got.numpy(), np.array(expected, dtype=np.float32))
assert rsplits.tolist() == [(src + rank) % 3 + 1 for src in range(size)]
rs_in = [data(r, 7 * size + 2, np.float64, seed=4).reshape(-1, 1) for r in range(size)]
rs = hvd.reducescatter(torch.from_numpy(rs_in[rank]), op=hvd.Sum)
total = np.sum(rs_in, axis=0)
mine = [7 + (1 if r < 2 else 0) for r in range(size)]  # Horovod's split of 7 * size + 2 rows
np.testing.assert_allclose(rs.numpy(), total[sum(mine[:rank]) : sum(mine[: rank + 1])], rtol=1e-12)
hvd.barrier()
mpi_calls, core_bytes = counters()[0] - calls, counters()[1] - sent
print(f"rank {rank} mpi path: mpi_calls {mpi_calls} core_bytes {core_bytes}", flush=True)

# What MPI does not reduce as torch does goes over the core's own transports: float16 (no MPI
# type), and sums of 8- and 16-bit integers, which wrap (Open MPI's AVX sum saturates them).
calls, sent = counters()
h = hvd.allreduce(torch.ones(1000, dtype=torch.float16) * (rank + 1), op=hvd.Sum, name="ar.fp16")
assert h.tolist() == [size * (size + 1) / 2] * 1000
for dtype in NARROW:
    top = np.full(100, np.iinfo(dtype).max, dtype=dtype)
    out = hvd.allreduce(torch.from_numpy(top), op=hvd.Sum, name=f"ar.wrap.{dtype.__name__}")
    np.testing.assert_array_equal(out.numpy(), (top.astype(np.int64) * size).astype(dtype))
mpi_calls, core_bytes = counters()[0] - calls, counters()[1] - sent
print(f"rank {rank} core path: mpi_calls {mpi_calls} core_bytes {core_bytes}", flush=True)

# A process set of the even ranks: its own MPI communicator.
evens = hvd.add_process_set(list(range(0, size, 2)))
if rank % 2 == 0:
    s = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=evens)
    assert s.item() == sum(range(0, size, 2)), s
hvd.remove_process_set(evens)

# BAGUA's compressed allreduce runs over the core's transports beside MPI. The gradient of
# sum(W @ ones) is all ones on every rank, which MinMaxUInt8 carries exactly: W - lr * 1.
from bagua_hvd.torch.algorithms import ByteGrad  # noqa: E402

w0 = data(rank, 4096, np.float32, seed=7).reshape(64, 64)
model = torch.nn.Linear(64, 64, bias=False)
with torch.no_grad():
    model.weight.copy_(torch.from_numpy(w0))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                               named_parameters=model.named_parameters(), algorithm=ByteGrad())  # fmt: skip
model(torch.ones(1, 64)).sum().backward()
opt.step()
np.testing.assert_allclose(model.weight.detach().numpy(), w0 - 0.5, rtol=0, atol=1e-6)
hvd.barrier()
print(f"rank {rank} OK", flush=True)
hvd.shutdown()
