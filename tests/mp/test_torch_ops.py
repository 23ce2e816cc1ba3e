"""bagua_hvd.torch collectives, run by every rank of a launched job (or alone at size 1).

Results are checked against numpy references (tests/reference.py) computed from every rank's
deterministic inputs. Run: ``bagua-run -np 2 python -m pytest -x -q tests/mp/test_torch_ops.py``.
"""

from __future__ import annotations

import os
import time
import warnings

import numpy as np
import pytest
import reference as ref
import torch
from helpers import MOVE_DTYPES, REDUCE_DTYPES, TORCH_DTYPES, check, inputs_for, to_torch

import bagua_hvd.torch as hvd
from bagua_hvd.common.exceptions import HorovodInternalError

OPS = {
    "Average": hvd.Average,
    "Sum": hvd.Sum,
    "Min": hvd.Min,
    "Max": hvd.Max,
    "Product": hvd.Product,
}
NOT_INIT = "Horovod has not been initialized; use hvd.init()."
DUPLICATE_NAME = (
    "Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
    "tensor that is currently being processed.  If you want to request another tensor, use a "
    "different tensor name."
)


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


def needs_peers(n: int = 2):
    return pytest.mark.skipif(
        int(os.environ.get("HOROVOD_SIZE", "1")) < n, reason=f"needs at least {n} ranks"
    )


def assert_job_works(tag: str = "after-error") -> None:
    """A correct collective right after an error: the job must still work."""
    x = torch.full((7,), float(rank() + 1))
    got = hvd.allreduce(x, op=hvd.Sum, name=f"works.{tag}")
    assert torch.equal(got, torch.full((7,), float(size() * (size() + 1) // 2))), got


# ---- basics ----------------------------------------------------------------------------------
def test_basics():
    expected_size = int(os.environ.get("HOROVOD_SIZE", "1"))
    expected_rank = int(os.environ.get("HOROVOD_RANK", "0"))
    assert hvd.is_initialized()
    assert hvd.size() == expected_size
    assert hvd.rank() == expected_rank
    assert hvd.local_rank() == int(os.environ.get("HOROVOD_LOCAL_RANK", "0"))
    assert hvd.local_size() == int(os.environ.get("HOROVOD_LOCAL_SIZE", "1"))
    assert hvd.cross_rank() == int(os.environ.get("HOROVOD_CROSS_RANK", "0"))
    assert hvd.cross_size() == int(os.environ.get("HOROVOD_CROSS_SIZE", "1"))
    assert hvd.mpi_ops.is_homogeneous() is True
    assert not hasattr(hvd, "is_homogeneous")  # only in mpi_ops, like Horovod
    # HOROVOD_CPU_OPERATIONS=mpi under mpirun (tests/test_mpi_ops.py): collectives through MPI.
    over_mpi = os.environ.get("HOROVOD_CPU_OPERATIONS", "").lower() == "mpi" and size() > 1
    assert hvd.mpi_enabled() is over_mpi and hvd.mpi_built() is True
    assert hvd.gloo_enabled() is True and hvd.gloo_built() is True
    assert isinstance(hvd.nccl_built(), int)
    assert hvd.ddl_built() is False and hvd.ccl_built() is False and hvd.rocm_built() is False
    assert isinstance(hvd.cuda_built(), bool)
    if over_mpi:
        assert hvd.mpi_threads_supported() is True  # mpi4py asks for MPI_THREAD_MULTIPLE
    else:
        with pytest.raises(ValueError, match="Horovod MPI is not enabled; Please make sure it's"):
            hvd.mpi_threads_supported()
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    assert hvd.global_process_set.process_set_id == 0
    assert hvd.global_process_set.ranks == list(range(size()))
    assert hvd.global_process_set.size() == size()
    assert hvd.global_process_set.rank() == rank()
    assert hvd.global_process_set.included() is True
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    hvd.init()  # a second init is a no-op
    assert hvd.size() == expected_size


def test_timeline_errors(monkeypatch):
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    with pytest.raises(ValueError, match="Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic"):
        hvd.start_timeline("/tmp/timeline.json")
    hvd.stop_timeline()  # as Horovod: stopping a timeline that does not run is no error
    # As Horovod, the environment is read at init: setting it afterwards enables nothing.
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    with pytest.raises(ValueError, match="Set HOROVOD_TIMELINE=DYNAMIC"):
        hvd.start_timeline("/tmp/timeline.json")


def test_all_exports():
    names = """Compression allreduce allreduce_async allreduce_ allreduce_async_
    grouped_allreduce grouped_allreduce_async grouped_allreduce_ grouped_allreduce_async_
    sparse_allreduce_async allgather allgather_async grouped_allgather grouped_allgather_async
    broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter
    reducescatter_async grouped_reducescatter grouped_reducescatter_async join barrier poll
    synchronize init shutdown is_initialized start_timeline stop_timeline size local_size
    cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built
    gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet
    global_process_set add_process_set remove_process_set Average Sum Adasum Min Max Product
    HorovodInternalError check_extension mpi_ops compression""".split()
    missing = [n for n in names if not hasattr(hvd, n)]
    assert not missing, missing
    assert hvd.Compression.none is hvd.compression.NoneCompressor
    assert hvd.Compression.fp16 is hvd.compression.FP16Compressor
    assert hvd.Compression.bf16 is hvd.compression.BF16Compressor


# ---- allreduce -------------------------------------------------------------------------------
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("dtype", REDUCE_DTYPES + ["bool"])
def test_allreduce(dtype, op):
    if dtype == "bool" and op == "Average":
        pytest.skip("Average is not defined for bool (see test_bool_allreduce_errors)")
    for dims in (1, 2, 3):
        shape = [5] * dims
        inputs = inputs_for(("allreduce", op, dims), size(), lambda r, s=shape: s, dtype)
        t = to_torch(inputs[rank()], dtype)
        before = t.clone()
        out = hvd.allreduce(t, op=OPS[op])
        expected = ref.allreduce(inputs, OPS[op], dtype)
        check(out, expected, dtype, ref.tolerance(dtype, OPS[op], size()), f"{op} {dims}D")
        assert torch.equal(t, before), "allreduce changed its input"


@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
def test_allreduce_scale_factors(dtype):
    for op in ("Sum", "Average"):
        for pre, post in ((2.0, 1.0), (1.0, 0.5), (0.5, 2.0), (1.5, 1.0), (1.0, 1.5)):
            inputs = inputs_for(("scale", op, pre, post), size(), lambda r: (4, 3), dtype)
            t = to_torch(inputs[rank()], dtype)
            out = hvd.allreduce(t, op=OPS[op], prescale_factor=pre, postscale_factor=post)
            expected = ref.allreduce(inputs, OPS[op], dtype, pre, post)
            tol = ref.tolerance(dtype, hvd.Average, size())  # 1.5 is not exact in float16
            check(out, expected, dtype, tol, f"{op} pre={pre} post={post}")


def test_allreduce_forms():
    dtype = "float32"
    inputs = inputs_for(("forms",), size(), lambda r: (6, 4), dtype)
    mine = inputs[rank()]
    expected_sum = ref.allreduce(inputs, ref.SUM, dtype)
    expected_avg = ref.allreduce(inputs, ref.AVERAGE, dtype)
    tol = ref.tolerance(dtype, ref.AVERAGE, size())

    # in place
    t = to_torch(mine, dtype)
    out = hvd.allreduce_(t, op=hvd.Sum)
    assert out is t
    check(t, expected_sum, dtype, 0, "allreduce_")
    # async, out of place
    t = to_torch(mine, dtype)
    h = hvd.allreduce_async(t, op=hvd.Sum, name="forms.async")
    assert isinstance(h, int)
    out = hvd.synchronize(h)
    check(out, expected_sum, dtype, 0, "allreduce_async")
    # async, in place
    t = to_torch(mine, dtype)
    h = hvd.allreduce_async_(t, name="forms.async_")
    out = hvd.synchronize(h)
    assert out is t
    check(t, expected_avg, dtype, tol, "allreduce_async_")
    # poll until done
    t = to_torch(mine, dtype)
    h = hvd.allreduce_async(t, op=hvd.Sum)
    while not hvd.poll(h):
        pass
    check(hvd.synchronize(h), expected_sum, dtype, 0, "poll")
    # deprecated average=
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_avg = hvd.allreduce(to_torch(mine, dtype), average=True)
        out_sum = hvd.allreduce(to_torch(mine, dtype), average=False)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    check(out_avg, expected_avg, dtype, tol, "average=True")
    check(out_sum, expected_sum, dtype, 0, "average=False")
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        hvd.allreduce(to_torch(mine, dtype), average=True, op=hvd.Sum)
    # explicit global process set; default op is Average
    out = hvd.allreduce(to_torch(mine, dtype), process_set=hvd.global_process_set)
    check(out, expected_avg, dtype, tol, "default op")


def test_allreduce_many_in_flight():
    dtype = "int32"
    n = 24
    cases = [
        inputs_for(("inflight", i), size(), lambda r, i=i: (i + 1, 3), dtype) for i in range(n)
    ]
    for rep in range(3):  # repeat names: the response cache path
        tensors = [to_torch(c[rank()], dtype) for c in cases]
        handles = [
            hvd.allreduce_async(t, op=hvd.Sum, name=f"inflight.{i}" if i % 2 else None)
            for i, t in enumerate(tensors)
        ]
        for i in reversed(range(n)):
            check(
                hvd.synchronize(handles[i]),
                ref.allreduce(cases[i], ref.SUM, dtype),
                dtype,
                0,
                f"in flight {i} rep {rep}",
            )


def test_allreduce_shapes_edge_cases():
    # empty tensor, 0-d scalar, large tensor (ring path / fusion buffer)
    e = torch.empty(0, dtype=torch.float32)
    assert hvd.allreduce(e, op=hvd.Sum).shape == (0,)
    s = torch.tensor(float(rank() + 1))
    got = hvd.allreduce(s, op=hvd.Sum)
    assert got.shape == () and got.item() == size() * (size() + 1) / 2
    n = 1 << 20
    big = torch.full((n,), float(rank() + 1))
    got = hvd.allreduce(big, op=hvd.Sum, name="big")
    assert torch.equal(got, torch.full((n,), float(size() * (size() + 1) // 2)))
    odd = torch.arange(12345, dtype=torch.float64) * (rank() + 1)
    got = hvd.allreduce(odd, op=hvd.Max)
    assert torch.equal(got, torch.arange(12345, dtype=torch.float64) * size())


def test_grouped_allreduce():
    specs = [
        ("float32", (5, 3)),
        ("int64", (7,)),
        ("float64", (2, 2, 2)),
        ("float32", (1,)),
        ("bfloat16", (9,)),
        ("int8", (4,)),
    ]
    cases = [
        inputs_for(("grouped", i), size(), lambda r, s=s: s, dt) for i, (dt, s) in enumerate(specs)
    ]
    exp_sum = [ref.allreduce(c, ref.SUM, dt) for c, (dt, _) in zip(cases, specs)]
    fresh = lambda: [to_torch(c[rank()], dt) for c, (dt, _) in zip(cases, specs)]  # noqa: E731

    outs = hvd.grouped_allreduce(fresh(), op=hvd.Sum, name="grouped.sync")
    assert isinstance(outs, list) and len(outs) == len(specs)
    for o, e, (dt, _) in zip(outs, exp_sum, specs):
        check(o, e, dt, 0, "grouped_allreduce")
    h = hvd.grouped_allreduce_async(fresh(), op=hvd.Sum)
    outs = hvd.synchronize(h)
    assert isinstance(outs, tuple)
    for o, e, (dt, _) in zip(outs, exp_sum, specs):
        check(o, e, dt, 0, "grouped_allreduce_async")
    ts = fresh()
    outs = hvd.grouped_allreduce_(ts, op=hvd.Sum, name="grouped.inplace")
    assert all(o is t for o, t in zip(outs, ts))
    for o, e, (dt, _) in zip(ts, exp_sum, specs):
        check(o, e, dt, 0, "grouped_allreduce_")
    ts = fresh()
    outs = hvd.synchronize(hvd.grouped_allreduce_async_(ts, op=hvd.Max))
    for o, c, (dt, _) in zip(ts, cases, specs):
        check(o, ref.allreduce(c, ref.MAX, dt), dt, 0, "grouped_allreduce_async_")
    outs = hvd.grouped_allreduce(fresh(), average=True)
    for o, c, (dt, _) in zip(outs, cases, specs):
        check(
            o,
            ref.allreduce(c, ref.AVERAGE, dt),
            dt,
            ref.tolerance(dt, ref.AVERAGE, size()),
            "grouped average",
        )
    with pytest.raises(ValueError, match="at least one tensor"):
        hvd.grouped_allreduce([])


def test_compression():
    inputs = inputs_for(("compression",), size(), lambda r: (33,), "float32")
    expected = ref.allreduce(inputs, ref.SUM, "float32")
    for comp in (hvd.Compression.none, hvd.Compression.fp16, hvd.Compression.bf16):
        out = hvd.allreduce(to_torch(inputs[rank()], "float32"), op=hvd.Sum, compression=comp)
        check(out, expected, "float32", 0, comp.__name__)
        outs = hvd.grouped_allreduce(
            [to_torch(inputs[rank()], "float32")], op=hvd.Sum, compression=comp
        )
        check(outs[0], expected, "float32", 0, comp.__name__)
    ints = torch.arange(4, dtype=torch.int32)
    c, ctx = hvd.Compression.fp16.compress(ints)
    assert c.dtype == torch.int32 and hvd.Compression.fp16.decompress(c, ctx).dtype == torch.int32
    c, ctx = hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.float64))
    assert c.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(c, ctx).dtype == torch.float64


def test_sparse_allreduce():
    n = size()
    idx = torch.tensor([[rank(), (rank() + 1) % 5]], dtype=torch.int64)
    vals = torch.tensor([1.0, 2.0]) * (rank() + 1)
    sp = torch.sparse_coo_tensor(idx, vals, (5,))
    for op in (hvd.Sum, hvd.Average):
        result = hvd.sparse_allreduce_async(sp, f"sparse.{op}", op)()
        assert result.is_sparse
        dense = torch.zeros(5, dtype=torch.float64)
        for r in range(n):
            dense[r % 5] += 1.0 * (r + 1)
            dense[(r + 1) % 5] += 2.0 * (r + 1)
        if op == hvd.Average:
            dense /= n
        assert torch.allclose(result.to_dense().double(), dense), (result.to_dense(), dense)


# ---- allgather -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_allgather(dtype):
    for dims in (1, 2, 3):
        shape_of = lambda r, d=dims: [r + 1] + [4] * (d - 1)  # noqa: E731  ranks differ in dim0
        inputs = inputs_for(("allgather", dims), size(), shape_of, dtype)
        out = hvd.allgather(to_torch(inputs[rank()], dtype))
        check(out, ref.allgather(inputs), dtype, 0, f"allgather {dims}D")
    # a rank with zero rows
    inputs = inputs_for(("allgather-empty",), size(), lambda r: (r % 2, 3), dtype)
    out = hvd.synchronize(hvd.allgather_async(to_torch(inputs[rank()], dtype), name="ag.e"))
    check(out, ref.allgather(inputs), dtype, 0, "allgather with empty rank")


def test_grouped_allgather():
    specs = [("float32", 3), ("int64", 1), ("bool", 2), ("uint8", 3)]
    cases = [
        inputs_for(("gag", i), size(), lambda r, d=d: [r + 2] + [3] * (d - 1), dt)
        for i, (dt, d) in enumerate(specs)
    ]
    outs = hvd.grouped_allgather(
        [to_torch(c[rank()], dt) for c, (dt, _) in zip(cases, specs)], name="gag"
    )
    assert isinstance(outs, list)
    for o, c, (dt, _) in zip(outs, cases, specs):
        check(o, ref.allgather(c), dt, 0, "grouped_allgather")
    h = hvd.grouped_allgather_async([to_torch(c[rank()], dt) for c, (dt, _) in zip(cases, specs)])
    outs = hvd.synchronize(h)
    assert isinstance(outs, tuple)
    for o, c, (dt, _) in zip(outs, cases, specs):
        check(o, ref.allgather(c), dt, 0, "grouped_allgather_async")


# ---- broadcast -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_broadcast(dtype):
    for root in range(size()):
        inputs = inputs_for(("broadcast", root), size(), lambda r: (3, 5), dtype)
        t = to_torch(inputs[rank()], dtype)
        before = t.clone()
        out = hvd.broadcast(t, root, name=f"bc.{dtype}.{root}")
        check(out, ref.broadcast(inputs, root), dtype, 0, f"broadcast root {root}")
        assert torch.equal(t, before), "broadcast changed its input"
        t = to_torch(inputs[rank()], dtype)
        assert hvd.broadcast_(t, root) is t
        check(t, ref.broadcast(inputs, root), dtype, 0, f"broadcast_ root {root}")
        t = to_torch(inputs[rank()], dtype)
        check(
            hvd.synchronize(hvd.broadcast_async(t, root)),
            ref.broadcast(inputs, root),
            dtype,
            0,
            "broadcast_async",
        )
        t = to_torch(inputs[rank()], dtype)
        assert hvd.synchronize(hvd.broadcast_async_(t, root)) is t
        check(t, ref.broadcast(inputs, root), dtype, 0, "broadcast_async_")


# ---- alltoall --------------------------------------------------------------------------------
def _splits(sender: int, n: int) -> list:
    return [(sender + receiver) % 3 for receiver in range(n)]


@pytest.mark.parametrize("dtype", MOVE_DTYPES)
def test_alltoall(dtype):
    n = size()
    splits = [_splits(s, n) for s in range(n)]
    for dims in (1, 2):
        inputs = inputs_for(
            ("alltoall", dims), n, lambda r, d=dims: [sum(splits[r])] + [3] * (d - 1), dtype
        )
        out, rsplits = hvd.alltoall(to_torch(inputs[rank()], dtype), splits=splits[rank()])
        exp, exp_splits = ref.alltoall(inputs, splits, rank())
        check(out, exp, dtype, 0, f"alltoall {dims}D")
        assert rsplits.dtype == torch.int32 and rsplits.tolist() == exp_splits
    # splits as an int32 tensor; async form returns (output, received_splits)
    inputs = inputs_for(("alltoall-t",), n, lambda r: [sum(splits[r]), 2], dtype)
    h = hvd.alltoall_async(
        to_torch(inputs[rank()], dtype), splits=torch.tensor(splits[rank()], dtype=torch.int32)
    )
    out, rsplits = hvd.synchronize(h)
    exp, exp_splits = ref.alltoall(inputs, splits, rank())
    check(out, exp, dtype, 0, "alltoall tensor splits")
    assert rsplits.tolist() == exp_splits
    # no splits: dim0 is divided evenly
    inputs = inputs_for(("alltoall-even",), n, lambda r: [2 * n, 3], dtype)
    out = hvd.alltoall(to_torch(inputs[rank()], dtype))
    even = [ref.even_splits(2 * n, n)] * n
    check(out, ref.alltoall(inputs, even, rank())[0], dtype, 0, "alltoall even")


# ---- reducescatter ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
def test_reducescatter(dtype):
    n = size()
    for op in ("Sum", "Average"):
        for dim0 in sorted({2 * n, 2 * n + 1, 1, n + n // 2}):
            inputs = inputs_for(("rs", op, dim0), n, lambda r, d=dim0: (d, 3), dtype)
            out = hvd.reducescatter(to_torch(inputs[rank()], dtype), op=OPS[op])
            exp = ref.reducescatter(inputs, OPS[op], dtype, rank())
            check(out, exp, dtype, ref.tolerance(dtype, OPS[op], n), f"rs {op} dim0={dim0}")
        inputs = inputs_for(("rs-scale", op), n, lambda r: (n + 1, 2), dtype)
        out = hvd.synchronize(
            hvd.reducescatter_async(
                to_torch(inputs[rank()], dtype),
                op=OPS[op],
                prescale_factor=2.0,
                postscale_factor=0.5,
            )
        )
        exp = ref.reducescatter(inputs, OPS[op], dtype, rank(), 2.0, 0.5)
        check(out, exp, dtype, ref.tolerance(dtype, OPS[op], n), f"rs async scaled {op}")


def test_reducescatter_default_op_is_average():
    n = size()
    inputs = inputs_for(("rs-default",), n, lambda r: (3 * n, 2), "float64")
    out = hvd.reducescatter(to_torch(inputs[rank()], "float64"))
    check(out, ref.reducescatter(inputs, ref.AVERAGE, "float64", rank()), "float64", 1e-12)


def test_grouped_reducescatter():
    n = size()
    specs = [("float32", (2 * n + 1, 3)), ("int32", (n, 2)), ("float64", (1,))]
    cases = [inputs_for(("grs", i), n, lambda r, s=s: s, dt) for i, (dt, s) in enumerate(specs)]
    fresh = lambda: [to_torch(c[rank()], dt) for c, (dt, _) in zip(cases, specs)]  # noqa: E731
    outs = hvd.grouped_reducescatter(fresh(), op=hvd.Sum, name="grs")
    assert isinstance(outs, list)
    for o, c, (dt, _) in zip(outs, cases, specs):
        check(o, ref.reducescatter(c, ref.SUM, dt, rank()), dt, 0, "grouped_reducescatter")
    outs = hvd.synchronize(hvd.grouped_reducescatter_async(fresh(), op=hvd.Average))
    assert isinstance(outs, tuple)
    for o, c, (dt, _) in zip(outs, cases, specs):
        check(
            o,
            ref.reducescatter(c, ref.AVERAGE, dt, rank()),
            dt,
            ref.tolerance(dt, ref.AVERAGE, n),
            "grouped_reducescatter_async",
        )


# ---- autograd --------------------------------------------------------------------------------
def test_allreduce_grad():
    n = size()
    for op, pre, post, factor in (
        (hvd.Sum, 1.0, 1.0, n),
        (hvd.Average, 1.0, 1.0, 1.0),
        (hvd.Sum, 2.0, 1.0, 2.0 * n),
        (hvd.Sum, 1.0, 0.5, 0.5 * n),
    ):
        x = torch.ones(4, 3, requires_grad=True)
        y = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
        y.backward(torch.ones(4, 3))
        assert torch.allclose(x.grad, torch.full((4, 3), float(factor))), (op, pre, post, x.grad)
    # grouped
    xs = [torch.ones(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum(y.sum() for y in ys).backward()
    for x in xs:
        assert torch.allclose(x.grad, torch.full(x.shape, float(n)))
    # average=True (deprecated) in backward too
    x = torch.ones(2, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        hvd.allreduce(x, average=True).sum().backward()
    assert torch.allclose(x.grad, torch.ones(2))


def test_allgather_grad():
    n, r = size(), rank()
    for dims in (1, 2):
        x = torch.ones([r + 1] + [3] * (dims - 1), requires_grad=True)
        gathered = hvd.allgather(x)
        grad_ys = torch.cat([torch.ones([s + 1] + [3] * (dims - 1)) * s for s in range(n)])
        gathered.backward(grad_ys)
        assert torch.equal(x.grad, torch.ones_like(x) * r), x.grad
    xs = [torch.ones(r + 1, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    outs = hvd.grouped_allgather(xs)
    grads = [
        torch.cat([torch.ones(s + 1) * s for s in range(n)]),
        torch.cat([torch.ones(2, 2) * (10 + s) for s in range(n)]),
    ]
    torch.autograd.backward(outs, grads)
    assert torch.equal(xs[0].grad, torch.ones(r + 1) * r)
    assert torch.equal(xs[1].grad, torch.ones(2, 2) * (10 + r))


def test_broadcast_grad():
    for root in range(size()):
        x = (torch.ones(5) * rank()).requires_grad_()
        y = hvd.broadcast(x, root)
        assert torch.equal(y.detach(), torch.ones(5) * root)
        y.backward(torch.ones(5))
        c = 1.0 if rank() == root else 0.0
        assert torch.equal(x.grad, torch.ones(5) * c), x.grad


def test_alltoall_grad():
    n, r = size(), rank()
    vals = []
    for i in range(n):
        vals += [float(i)] * (r + 1)
    x = torch.tensor(vals, requires_grad=True)
    out, rsplits = hvd.alltoall(x, splits=[r + 1] * n)
    assert rsplits.tolist() == [s + 1 for s in range(n)]
    out.backward(torch.ones(out.shape))
    assert torch.equal(x.grad, torch.ones(x.shape))
    # without splits only the output comes back
    y = torch.arange(2.0 * n, requires_grad=True)
    out = hvd.alltoall(y)
    assert isinstance(out, torch.Tensor)
    (out * 3).sum().backward()
    assert torch.equal(y.grad, torch.full((2 * n,), 3.0))


def test_reducescatter_grad():
    n = size()
    for op in (hvd.Sum, hvd.Average):
        x = torch.ones(n * 4, 3, requires_grad=True)
        y = hvd.reducescatter(x, op=op)
        y.backward(torch.ones(y.shape))
        expected = float(n) if op == hvd.Sum else 1.0
        assert torch.equal(x.grad, torch.full(x.shape, expected)), (op, x.grad)
    x = torch.ones(n * 2, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=3.0).sum().backward()
    assert torch.equal(x.grad, torch.full(x.shape, 6.0 * n))
    xs = [torch.ones(n * 2, requires_grad=True), torch.ones(n, 2, requires_grad=True)]
    ys = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    sum(y.sum() for y in ys).backward()
    for x in xs:
        assert torch.equal(x.grad, torch.full(x.shape, float(n)))


# ---- errors ----------------------------------------------------------------------------------
def test_unsupported_dtypes_and_layouts():
    c = torch.ones(4, dtype=torch.complex64)
    with pytest.raises(ValueError, match=r"^Tensor type torch.ComplexFloatTensor is not supported"):
        hvd.allreduce(c)
    with pytest.raises(ValueError, match="Tensor type torch.ComplexFloatTensor is not supported."):
        hvd.allgather(c)
    with pytest.raises(ValueError, match="Tensor type torch.ComplexFloatTensor is not supported."):
        hvd.broadcast(c, 0)
    with pytest.raises(ValueError, match="Tensor type torch.ComplexFloatTensor is not supported."):
        hvd.alltoall(c)
    with pytest.raises(ValueError, match="Tensor type torch.BoolTensor is not supported."):
        hvd.reducescatter(torch.ones(4, dtype=torch.bool), op=hvd.Sum)
    with pytest.raises(ValueError, match="is not supported."):
        hvd.allreduce(torch.ones(4, dtype=torch.uint16), op=hvd.Sum)
    nc = torch.ones(4, 6)[:, ::2]
    assert not nc.is_contiguous()
    for fn in (
        lambda: hvd.allreduce(nc),
        lambda: hvd.allgather(nc),
        lambda: hvd.broadcast(nc, 0),
        lambda: hvd.alltoall(nc),
        lambda: hvd.reducescatter(nc),
        lambda: hvd.allreduce_(nc),
        lambda: hvd.grouped_allreduce([torch.ones(2), nc]),
    ):
        with pytest.raises(ValueError, match=r"^Tensor is required to be contiguous.$"):
            fn()
    assert_job_works("dtypes")


def test_bool_allreduce_errors():
    b = torch.tensor([True, False])
    with pytest.raises(ValueError, match="Tensor type torch.BoolTensor is not supported"):
        hvd.allreduce(b)  # default op: Average
    with pytest.raises(ValueError, match="logical"):
        hvd.allreduce(b, op=hvd.Sum, prescale_factor=2.0)
    assert_job_works("bool")


def test_handle_errors():
    assert hvd.synchronize(987654321) is None
    with pytest.raises(ValueError, match="Handle 987654321 was not created or has been cleared"):
        hvd.poll(987654321)


def test_rank_zero_tensor_errors():
    with pytest.raises(
        HorovodInternalError, match="Process-set rank zero tried to ALLGATHER a rank-zero tensor."
    ):
        hvd.allgather(torch.tensor(1.0))
    assert_job_works("allgather-0d")
    with pytest.raises(
        HorovodInternalError,
        match="Process-set rank zero tried to REDUCESCATTER a rank-zero tensor.",
    ):
        hvd.reducescatter(torch.tensor(1.0), op=hvd.Sum)
    assert_job_works("reducescatter-0d")


def test_reducescatter_op_errors():
    for op in (hvd.Min, hvd.Max, hvd.Product):
        with pytest.raises(
            ValueError, match="Reducescatter currently only supports AVERAGE and SUM."
        ):
            hvd.reducescatter(torch.ones(4), op=op)
    with pytest.raises((ValueError, NotImplementedError)):
        hvd.reducescatter(torch.ones(4), op=hvd.Adasum)
    assert_job_works("rs-op")


def test_alltoall_split_errors():
    n = size()
    t = torch.ones(2 * n + (1 if n > 1 else 0))
    if n > 1:
        with pytest.raises(
            ValueError,
            match="splits not provided, but first dimension of tensor "
            "is not an even multiple of the number of workers.",
        ):
            hvd.alltoall(t)
    with pytest.raises(
        ValueError, match="Number of entries in splits does not equal number of workers."
    ):
        hvd.alltoall(t, splits=[1] * (n + 1))
    with pytest.raises(
        ValueError, match="Sum of splits entries is greater than the first dimension of tensor."
    ):
        hvd.alltoall(t, splits=[t.shape[0] + 1] + [0] * (n - 1))
    with pytest.raises(ValueError, match="alltoall expects splits to contain 32-bit integer"):
        hvd.alltoall(t, splits=torch.ones(n, dtype=torch.int64))
    with pytest.raises(ValueError, match="alltoall expects a 1D splits tensor"):
        hvd.alltoall(t, splits=torch.ones(1, n, dtype=torch.int32))
    assert_job_works("a2a")


def test_broadcast_root_errors():
    n = size()
    for bad in (n, -1, 2**31, -(2**31) - 1, 2**40):  # beyond int32 too: ValueError, not Overflow
        with pytest.raises(
            ValueError, match=f"broadcast received invalid root rank {bad} for provided process set"
        ):
            hvd.broadcast(torch.ones(3), bad)
    assert_job_works("root")


def test_unregistered_process_set_errors():
    ps = hvd.ProcessSet(list(range(size())))  # never registered: id None
    cases = [
        ("Allreduce", lambda: hvd.allreduce(torch.ones(2), process_set=ps)),
        ("Allgather", lambda: hvd.allgather(torch.ones(2), process_set=ps)),
        ("Broadcast", lambda: hvd.broadcast(torch.ones(2), 0, process_set=ps)),
        ("Alltoall", lambda: hvd.alltoall(torch.ones(size()), process_set=ps)),
        ("Reducescatter", lambda: hvd.reducescatter(torch.ones(2), process_set=ps)),
    ]
    for op, fn in cases:
        with pytest.raises(
            ValueError,
            match=f"{op}: Process set provided does not exist, or has not been registered.",
        ):
            fn()
    assert_job_works("ps")


def test_scale_factor_errors():
    """NaN and infinite factors are refused at the call, on every rank, naming the factor."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        for kw in ({"prescale_factor": bad}, {"postscale_factor": bad}):
            (key,) = kw
            with pytest.raises(ValueError, match=f"{key} must be a finite number, got {bad!r}"):
                hvd.allreduce(torch.ones(3), op=hvd.Sum, name="nan.scale", **kw)
            with pytest.raises(ValueError, match=f"{key} must be a finite number"):
                hvd.reducescatter(torch.ones(size(), 2), op=hvd.Sum, **kw)
    assert_job_works("nan-scale")


def test_duplicate_name_outcome_does_not_depend_on_timing():
    """A name stays taken until its caller has seen the first request complete (synchronize, or
    a poll that returned True), not merely until the background thread has finished it: the
    second enqueue is then refused on every rank, whether or not the op has completed there.

    Each round one rank submits late; by the time it tries the duplicate, the op has completed
    in its core (every peer had submitted long before), while on the others it is still pending
    when they try theirs. Horovod's rule (refuse only while pending) accepted the duplicate on
    the late rank alone, and the job hung on it."""
    t = torch.ones(5)
    for late in range(size()):
        name = f"dup.timing.{late}"
        if rank() == late:
            time.sleep(0.3)
        h = hvd.allreduce_async(t, name=name, op=hvd.Sum)
        if rank() == late:
            time.sleep(0.3)  # the op completes in the core meanwhile; nobody looks at it
        with pytest.raises(ValueError, match=DUPLICATE_NAME.replace(".", r"\.")):
            hvd.allreduce_async(t, name=name, op=hvd.Sum)
        assert torch.equal(hvd.synchronize(h), t * size())
        # Seen complete: the name is free again on every rank.
        assert torch.equal(hvd.allreduce(t, name=name, op=hvd.Sum), t * size())
        # A poll() that returned True counts as seen too.
        h = hvd.allreduce_async(t, name=name, op=hvd.Sum)
        while not hvd.poll(h):
            time.sleep(0.001)
        h2 = hvd.allreduce_async(t, name=name, op=hvd.Sum)
        assert torch.equal(hvd.synchronize(h2), t * size())
        assert torch.equal(hvd.synchronize(h), t * size())
    assert_job_works("dup-timing")


@needs_peers()
def test_duplicate_name_error():
    """A second enqueue under a pending name fails at once; the first op still completes.

    "Pending" must be certain: each name is held back by a rank that submits it only after a
    barrier (a fast peer could otherwise complete the op between the two enqueues).
    """
    t = torch.ones(17, 17)
    handles = []
    if rank() == 0:  # "dup.a" stays pending until the others submit it after the barrier
        handles.append(hvd.allreduce_async(t, name="dup.a"))
        with pytest.raises(ValueError, match=DUPLICATE_NAME.replace(".", r"\.")):
            hvd.allreduce_async(t, name="dup.a")
    hvd.barrier()
    if rank() > 0:  # "dup.b" stays pending until rank 0 submits it after the next barrier
        handles.append(hvd.allreduce_async(t, name="dup.a"))
        handles.append(hvd.allreduce_async(t, name="dup.b"))
        with pytest.raises(ValueError, match="Requested to allreduce, allgather, or broadcast"):
            hvd.allreduce_async(t, name="dup.b")
    hvd.barrier()
    if rank() == 0:
        handles.append(hvd.allreduce_async(t, name="dup.b"))
    for h in handles:
        assert torch.equal(hvd.synchronize(h), t)
    assert_job_works("dup")


def _expect_internal(fn, text):
    with pytest.raises(HorovodInternalError, match=text):
        fn()


@needs_peers()
def test_mismatch_errors_every_rank():
    r = rank()
    # shapes
    dims = [17 + r] * 3
    _expect_internal(
        lambda: hvd.allreduce(torch.ones(*dims), name="mm.shape"),
        r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape \[",
    )
    assert_job_works("mm-shape")
    # dtypes
    dt = torch.float32 if r % 2 == 0 else torch.int32
    _expect_internal(
        lambda: hvd.allreduce(torch.ones(5, dtype=dt), op=hvd.Sum, name="mm.dtype"),
        "Mismatched data types: One rank had type",
    )
    assert_job_works("mm-dtype")
    # different operations under one core name (the frontends prefix names with the op, so
    # this goes through the framework-neutral layer)
    _expect_internal(lambda: _raw_same_name_op(r), "Mismatched operations: One rank did an")
    assert_job_works("mm-op")
    # reduce ops
    _expect_internal(
        lambda: hvd.allreduce(torch.ones(3), name="mm.rop", op=hvd.Sum if r == 0 else hvd.Average),
        "Mismatched reduction operation: One rank sent reduction op",
    )
    assert_job_works("mm-rop")
    # scale factors
    _expect_internal(
        lambda: hvd.allreduce(
            torch.ones(3), op=hvd.Sum, name="mm.scale", prescale_factor=1.0 + (r == 0)
        ),
        r"Mismatched prescale and/or postscale factors: One rank sent factors \(",
    )
    assert_job_works("mm-scale")
    # broadcast roots
    _expect_internal(
        lambda: hvd.broadcast(torch.ones(3), 0 if r == 0 else 1, name="mm.root"),
        "Mismatched BROADCAST root ranks: One rank specified root rank",
    )
    assert_job_works("mm-root")
    # allgather rank and trailing dims
    _expect_internal(
        lambda: hvd.allgather(torch.ones([2] * (2 + (r == 0))), name="mm.agrank"),
        "Mismatched ALLGATHER tensor shapes: One rank sent a tensor of rank",
    )
    _expect_internal(
        lambda: hvd.allgather(torch.ones(2, 17 + (r == 0)), name="mm.agdim"),
        "Mismatched ALLGATHER tensor shapes: One rank sent a tensor with dimension 1 equal to",
    )
    assert_job_works("mm-ag")
    # async: the error surfaces at synchronize, the handle is gone afterwards
    h = hvd.allreduce_async(torch.ones(3 + r), name="mm.async")
    _expect_internal(lambda: hvd.synchronize(h), "Mismatched ALLREDUCE tensor shapes")
    assert hvd.synchronize(h) is None
    assert_job_works("mm-async")


def _raw_same_name_op(r: int) -> None:
    """Rank 0 allreduces and the others allgather a tensor under the same core name."""
    from bagua_hvd.common import ops

    x, out = torch.ones(4), torch.empty(4)
    handle, keep = ops.enqueue(
        ops.OP_ALLREDUCE if r == 0 else ops.OP_ALLGATHER,
        [(x.data_ptr(), ops.FLOAT32, (4,))],
        [(out.data_ptr(), ops.FLOAT32, (4,))] if r == 0 else None,
        name="mixed.op",
        urgent=True,
    )
    try:
        ops.wait(handle, "mixed.op")
    finally:
        ops.release(handle)
        del keep


# ---- join and barrier ------------------------------------------------------------------------
def test_barrier():
    """A barrier returns on no rank before every rank has called it: each round one rank (each
    rank in turn) arrives late, and every rank finds, right after the barrier, the marker file
    that the late rank wrote just before calling it."""
    import shutil
    import tempfile
    from pathlib import Path

    n, r = size(), rank()
    shared = Path(hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else "", root_rank=0))
    try:
        for rnd in range(max(n, 2)):
            late = rnd % n
            barrier = (
                hvd.barrier
                if rnd % 2 == 0
                else lambda: hvd.barrier(process_set=hvd.global_process_set)
            )
            if r == late:
                time.sleep(0.3)  # the others are in the barrier by now (or passed it: wrong)
            (shared / f"arrived.{rnd}.{r}").touch()
            barrier()
            missing = [q for q in range(n) if not (shared / f"arrived.{rnd}.{q}").exists()]
            assert not missing, f"round {rnd}: the barrier returned before ranks {missing} arrived"
        hvd.barrier()  # nobody removes the folder while another rank still looks into it
    finally:
        if r == 0:
            shutil.rmtree(shared, ignore_errors=True)


def test_join_size_one_or_all_at_once():
    # every rank joins at once: the last rank to join is one of them, the same everywhere
    last = hvd.join()
    assert 0 <= last < size()
    gathered = hvd.allgather(torch.tensor([last]))
    assert gathered.tolist() == [last] * size()
    assert_job_works("join-all")


# Unnamed ops are named "<op>.noname.<n>", n counting this process's unnamed ops of that kind
# and set, so every rank must enqueue the same number of them: the join tests rotate roles so
# that each rank does the same work over a whole test.


@needs_peers()
@pytest.mark.parametrize("dtype", ["int32", "int64", "float32", "float64"])
def test_join_allreduce_staggered(dtype):
    """The rank with role q runs q allreduce pairs, then joins; joined ranks contribute zeros."""
    n, r = size(), rank()
    for rnd in range(n):
        role = (r + rnd) % n
        holder = [(q - rnd) % n for q in range(n)]  # holder[q]: the rank with role q
        cases = [
            inputs_for(("join", rnd, k), n, lambda q: (5, 3), dtype, -100, 100)
            for k in range(n - 1)
        ]
        for k in range(role):
            mine = to_torch(cases[k][r], dtype)
            got_sum = hvd.allreduce(mine, op=hvd.Sum, name=f"join.sum.{k}")
            got_avg = hvd.allreduce(mine, op=hvd.Average, name=f"join.avg.{k}")
            joined = [holder[q] for q in range(k + 1)]  # roles 0..k joined before allreduce k
            check(
                got_sum,
                ref.join_allreduce(cases[k], joined, ref.SUM, dtype),
                dtype,
                0,
                f"join sum {k} round {rnd}",
            )
            check(
                got_avg,
                ref.join_allreduce(cases[k], joined, ref.AVERAGE, dtype),
                dtype,
                ref.tolerance(dtype, ref.AVERAGE, n),
                f"join avg {k} round {rnd}",
            )
        last = hvd.join()
        assert last == holder[n - 1], f"join returned {last}, expected {holder[n - 1]}"
    assert_job_works("join")


@needs_peers()
def test_join_first_rank_and_grouped():
    """Horovod's pattern: one rank joins first; the others allreduce (fused) then join."""
    n, r = size(), rank()
    for first in range(n):
        a = torch.arange(25, dtype=torch.float32).view(5, 5) + r
        b = torch.arange(17, dtype=torch.float32) * (r + 1)
        if r == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(a, name="tensor_a", op=hvd.Sum)
            hb = hvd.allreduce_async(b, name="tensor_b", op=hvd.Sum)
            ga, gb = hvd.synchronize(ha), hvd.synchronize(hb)
            others = [q for q in range(n) if q != first]
            ea = sum(torch.arange(25, dtype=torch.float32).view(5, 5) + q for q in others)
            eb = sum(torch.arange(17, dtype=torch.float32) * (q + 1) for q in others)
            assert torch.equal(ga, ea) and torch.equal(gb, eb)
            ret = hvd.join()
        assert ret != first
        assert hvd.allgather(torch.tensor([ret]), name="join.ret").tolist() == [ret] * n


@needs_peers()
def test_join_with_allgather_fails():
    for first in range(size()):
        if rank() == first:
            hvd.join()
        else:
            with pytest.raises(
                HorovodInternalError, match="Allgather is not supported with Join at this time."
            ):
                hvd.allgather(torch.ones(2), name="join.ag")
            hvd.join()
    assert_job_works("join-ag")


# ---- lifecycle -------------------------------------------------------------------------------
def test_ops_before_init_and_reinit():
    hvd.barrier()  # any rank's shutdown stops the whole job: wait for the others first
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=NOT_INIT):
        hvd.rank()
    with pytest.raises(ValueError, match=NOT_INIT):
        hvd.size()
    with pytest.raises(ValueError, match=NOT_INIT):
        hvd.allreduce(torch.ones(2))
    with pytest.raises(ValueError, match=NOT_INIT):
        hvd.start_timeline("/tmp/x.json")
    with pytest.raises(ValueError, match=NOT_INIT):
        hvd.global_process_set.size()
    hvd.shutdown()  # twice is fine
    hvd.init()
    assert_job_works("reinit")


def test_pending_handle_fails_at_shutdown_no_hang():
    if size() == 1:
        pytest.skip("needs a peer that never submits")
    # Every rank submits a tensor nobody else submits, then shuts down: shutdown must not hang
    # on the pending handles, and everyone re-initializes cleanly. The second barrier keeps a
    # fast rank's shutdown (which stops every rank) from overtaking a slow rank's enqueue.
    hvd.barrier()
    t = torch.ones(3)
    h = hvd.allreduce_async_(t, name=f"never.matched.{rank()}")
    hvd.barrier()
    hvd.shutdown()
    # Horovod's shutdown clears its handle manager, not its Python handle map: waiting raises
    # the manager's ValueError (it returned None before, the in-place tensor silently unreduced)
    with pytest.raises(ValueError, match=f"^Handle {h} was not created or has been cleared.$"):
        hvd.synchronize(h)
    assert torch.equal(t, torch.ones(3))
    assert hvd.synchronize(h) is None  # gone from the map, as in Horovod
    hvd.init()
    assert_job_works("after-pending-shutdown")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors():
    dev = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    n = size()
    x = torch.full((1000,), float(rank() + 1), device=dev)
    got = hvd.allreduce(x, op=hvd.Sum)
    assert got.device == dev and torch.equal(got.cpu(), torch.full((1000,), n * (n + 1) / 2))
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Max) is y and y.device == dev
    assert torch.equal(y.cpu(), torch.full((1000,), float(n)))
    g = hvd.allgather(torch.ones(rank() + 1, 2, device=dev))
    assert g.device == dev and g.shape == (n * (n + 1) // 2, 2)
    b = hvd.broadcast(x, 0)
    assert b.device == dev and torch.equal(b.cpu(), torch.ones(1000))
    rs = hvd.reducescatter(torch.ones(2 * n, device=dev), op=hvd.Sum)
    assert rs.device == dev and torch.equal(rs.cpu(), torch.full((2,), float(n)))
    a, s = hvd.alltoall(torch.ones(n, device=dev), splits=[1] * n)
    assert a.device == dev and s.tolist() == [1] * n
    w = torch.ones(3, device=dev, requires_grad=True)
    hvd.allreduce(w, op=hvd.Sum).sum().backward()
    assert torch.equal(w.grad.cpu(), torch.full((3,), float(n)))
    outs = hvd.grouped_allreduce([x, torch.ones(5, device=dev)], op=hvd.Sum)
    assert all(o.device == dev for o in outs)


def test_dtype_table_complete():
    # every dtype the tests use maps to a torch dtype and back
    for name in MOVE_DTYPES:
        assert TORCH_DTYPES[name] is not None
    assert np.dtype("float32") == ref.numpy_dtype("bfloat16")
