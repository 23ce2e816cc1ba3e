"""bagua_hvd.tensorflow collectives against numpy references, eagerly and inside tf.function.

Runs inside a launched job (tests/test_tf_ops.py starts it at 1, 2 and 3 ranks). Every rank
builds every rank's input from a shared seed, so each rank can compute the expected answer with
numpy (tests/reference.py) and check its own result.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import reference as ref  # noqa: E402  (tests/ is on sys.path via tests/mp/conftest.py)

import bagua_hvd.tensorflow as hvd  # noqa: E402

DTYPES = ["float32", "float64", "int32", "int64", "float16", "bfloat16"]
TF_DTYPES = {
    "float32": tf.float32,
    "float64": tf.float64,
    "int32": tf.int32,
    "int64": tf.int64,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "int8": tf.int8,
    "uint8": tf.uint8,
    "bool": tf.bool,
}
MODES = ["eager", "graph"]
# the collectives inside tf.function run as asynchronous kernels;
# "graph-numpy" runs them through the numpy_function path too (the kernels' fallback).
KERNEL_MODES = MODES + ["graph-numpy"]


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    """The TF frontend shares the core with bagua_hvd.torch (initialized by the conftest):
    its init is a no-op then."""
    hvd.init()
    assert hvd.is_initialized()
    yield


def size():
    return hvd.size()


def rank():
    return hvd.rank()


def run(mode, fn):
    """Calls ``fn`` eagerly or as a freshly traced tf.function (see KERNEL_MODES)."""
    if mode == "eager":
        return fn()
    if mode == "graph":
        return tf.function(fn)()
    assert mode == "graph-numpy", mode
    hvd.mpi_ops._collective_kernel[0] = False
    try:
        return tf.function(fn)()
    finally:
        hvd.mpi_ops._collective_kernel[0] = True


def to_tf(a, dtype):
    return tf.constant(a.astype(np.float32) if dtype == "bfloat16" else a, dtype=TF_DTYPES[dtype])


def check(got, expected, dtype, tol=0.0, what=""):
    assert got.dtype == TF_DTYPES[dtype], f"{what}: dtype {got.dtype} != {dtype}"
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: {got.shape} != {expected.shape}"
    g = got.numpy()
    if dtype in ref.FLOAT_TYPES:
        np.testing.assert_allclose(
            g.astype(np.float64), expected.astype(np.float64), rtol=0, atol=tol, err_msg=what
        )
    else:
        np.testing.assert_array_equal(g, expected.astype(g.dtype), err_msg=what)


def inputs(case, dtype, shape_of, low=-4, high=4):
    seed = ref.seed_for(*case, dtype)
    return [ref.make_input(seed, r, shape_of(r), dtype, low, high) for r in range(size())]


# ---- basics ------------------------------------------------------------------------------------
def test_exports_and_queries():
    for name in (
        "allreduce grouped_allreduce allgather grouped_allgather broadcast broadcast_ alltoall "
        "reducescatter grouped_reducescatter join init shutdown is_initialized start_timeline "
        "stop_timeline size local_size cross_size rank local_rank cross_rank is_homogeneous "
        "rank_op local_rank_op size_op local_size_op process_set_included_op "
        "mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built "
        "ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set "
        "add_process_set remove_process_set Average Sum Adasum Min Max Product "
        "handle_average_backwards_compatibility check_num_rank_power_of_2 Compression "
        "allgather_object broadcast_object broadcast_object_fn broadcast_variables"
    ).split():
        assert hasattr(hvd, name), name
    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    for mode in MODES:
        got = run(
            mode,
            lambda: (
                hvd.size_op(), hvd.rank_op(), hvd.local_size_op(), hvd.local_rank_op(),
                hvd.process_set_included_op(),
            ),
        )  # fmt: skip
        assert [int(v) for v in got] == [size(), rank(), hvd.local_size(), hvd.local_rank(), 1]
        assert all(v.dtype == tf.int32 for v in got)
    with pytest.raises(tf.errors.InvalidArgumentError, match="does not exist"):
        hvd.size_op(process_set_id=4242)


# ---- allreduce ---------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Parameter `average`:DeprecationWarning")
@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mode, dtype):
    n = size()
    ins = inputs(("allreduce",), dtype, lambda r: (3, 5), low=1 if dtype in ref.INT_TYPES else -4)
    mine = to_tf(ins[rank()], dtype)
    ops = [hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
    got = run(mode, lambda: [hvd.allreduce(mine, op=op) for op in ops])
    for op, g in zip(ops, got):
        expected = ref.allreduce(ins, op, dtype)
        check(g, expected, dtype, ref.tolerance(dtype, op, n), f"op {op}")
    # scale factors, average=, name=
    got = run(
        mode,
        lambda: (
            hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5, name="s"),
            hvd.allreduce(mine, average=False),
            hvd.allreduce(mine),
        ),
    )
    check(got[0], ref.allreduce(ins, ref.SUM, dtype, 2.0, 0.5), dtype, 0, "scaled")
    check(got[1], ref.allreduce(ins, ref.SUM, dtype), dtype, 0, "average=False")
    check(got[2], ref.allreduce(ins, ref.AVERAGE, dtype), dtype, ref.tolerance(dtype, 0, n))


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_grouped_allreduce_and_compression(mode):
    n = size()
    a = inputs(("ga", 0), "float32", lambda r: (4,))
    b = inputs(("ga", 1), "int64", lambda r: (2, 3))
    ta, tb = to_tf(a[rank()], "float32"), to_tf(b[rank()], "int64")
    got = run(mode, lambda: hvd.grouped_allreduce([ta, tb], op=hvd.Sum))
    check(got[0], ref.allreduce(a, ref.SUM, "float32"), "float32", 0, "grouped[0]")
    check(got[1], ref.allreduce(b, ref.SUM, "int64"), "int64", 0, "grouped[1]")
    for comp, wire in ((hvd.Compression.fp16, "float16"), (hvd.Compression.bf16, "bfloat16")):
        got = run(mode, lambda comp=comp: hvd.allreduce(ta, op=hvd.Sum, compression=comp))
        check(got, ref.allreduce(a, ref.SUM, "float32"), "float32", 0, f"compressed {wire}")
        got = run(mode, lambda comp=comp: hvd.grouped_allreduce([ta], compression=comp))[0]
        check(got, ref.allreduce(a, ref.AVERAGE, "float32"), "float32", 5e-2, "grouped comp")
    assert n >= 1


SPARSE_DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
# Horovod's Average of tf.IndexedSlices is `values / tf.cast(size, dtype)`, TensorFlow's true
# division: integer values come back as these floating dtypes (floats keep theirs).
TRUEDIV = {"uint8": np.float32, "int8": np.float32, "int32": np.float64, "int64": np.float64}


def sparse_average(values, n, dtype):
    """Horovod's Average of gathered IndexedSlices values, computed by numpy: the values and
    the size in the result dtype, divided (numpy's float16 division rounds like TF's)."""
    out = np.dtype(TRUEDIV.get(dtype, ref.numpy_dtype(dtype)))
    return values.astype(out) / np.asarray(n, out)


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", SPARSE_DTYPES)
def test_allreduce_indexed_slices(mode, dtype):
    """allreduce and grouped_allreduce of tf.IndexedSlices (alone and mixed with dense tensors)
    as Horovod 0.28.1: values and indices allgathered, Average divides the values by the set
    size in TensorFlow's true division (integers become floating point)."""
    n, r = size(), rank()
    vals = inputs(("is", 0), dtype, lambda q: (q + 1, 3), low=-4, high=9)
    vals2 = inputs(("is", 1), dtype, lambda q: (2, 2), low=-4, high=9)
    dense = inputs(("is", 2), dtype, lambda q: (4,), low=1)
    idx = [np.arange(q + 1, dtype=np.int64) + q for q in range(n)]
    idx2 = [np.array([q, q + 1], np.int32) for q in range(n)]
    sl = tf.IndexedSlices(to_tf(vals[r], dtype), tf.constant(idx[r]), tf.constant([9, 3]))
    sl2 = tf.IndexedSlices(to_tf(vals2[r], dtype), tf.constant(idx2[r]))
    td = to_tf(dense[r], dtype)
    ops = (hvd.Sum, hvd.Average)
    got = run(
        mode,
        lambda: [
            (hvd.allreduce(sl, op=op), hvd.grouped_allreduce([sl, td, sl2], op=op)) for op in ops
        ],
    )
    for op, (single, grouped) in zip(ops, got):
        what = f"op {op}"
        for out, v, ix in ((single, vals, idx), (grouped[0], vals, idx), (grouped[2], vals2, idx2)):
            assert isinstance(out, tf.IndexedSlices), what
            gathered = np.concatenate(v)
            expect = gathered if op == hvd.Sum else sparse_average(gathered, n, dtype)
            assert out.values.dtype.as_numpy_dtype == expect.dtype, (what, out.values.dtype)
            # Eagerly the division is exact; in a graph Grappler turns x / c into x * (1 / c),
            # for Horovod as here: one rounding more.
            rtol = 0 if mode == "eager" or op == hvd.Sum else np.finfo(expect.dtype).eps
            np.testing.assert_allclose(out.values.numpy(), expect, rtol=rtol, atol=0, err_msg=what)
            np.testing.assert_array_equal(out.indices.numpy(), np.concatenate(ix), err_msg=what)
        assert out.dense_shape is None and grouped[0].dense_shape.numpy().tolist() == [9, 3]
        ref_op = ref.SUM if op == hvd.Sum else ref.AVERAGE
        check(
            grouped[1], ref.allreduce(dense, ref_op, dtype), dtype, ref.tolerance(dtype, ref_op, n)
        )


def test_allreduce_indexed_slices_errors():
    """Horovod raises NotImplementedError for ops other than Sum/Average and for scale factors
    on tf.IndexedSlices, on every rank before any collective (so the job goes on)."""
    sl = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([rank()]))
    dense = tf.ones([2])
    for mode in MODES:
        for op in (hvd.Min, hvd.Max, hvd.Product):
            with pytest.raises(NotImplementedError, match="Only Sum and Average ops are supported"):
                run(mode, lambda op=op: hvd.allreduce(sl, op=op))
            with pytest.raises(NotImplementedError, match="Only Sum and Average ops are supported"):
                run(mode, lambda op=op: hvd.grouped_allreduce([sl, dense], op=op))
        for fn in (hvd.allreduce, lambda t, **kw: hvd.grouped_allreduce([t, dense], **kw)):
            with pytest.raises(NotImplementedError, match="Adasum reduction does not currently"):
                run(mode, lambda fn=fn: fn(sl, op=hvd.Adasum))
            for kw in ({"prescale_factor": 0.5}, {"postscale_factor": 0.5}):
                with pytest.raises(
                    NotImplementedError, match="Pre/postscale_factor are not supported with tf.Ind"
                ):
                    run(mode, lambda fn=fn, kw=kw: fn(sl, op=hvd.Sum, **kw))
    got = hvd.allreduce(sl, op=hvd.Sum)
    np.testing.assert_array_equal(got.indices.numpy(), np.arange(size()))


# ---- allgather / broadcast / alltoall / reducescatter ------------------------------------------
@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", DTYPES + ["int8", "uint8", "bool"])
def test_allgather(mode, dtype):
    ins = inputs(("allgather",), dtype, lambda q: (q + 1, 2))
    mine = to_tf(ins[rank()], dtype)
    other = to_tf(ins[rank()][:, :1], dtype)
    got = run(mode, lambda: (hvd.allgather(mine), hvd.grouped_allgather([mine, other])))
    check(got[0], ref.allgather(ins), dtype, 0, "allgather")
    check(got[1][0], ref.allgather(ins), dtype, 0, "grouped[0]")
    check(got[1][1], ref.allgather([a[:, :1] for a in ins]), dtype, 0, "grouped[1]")


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_broadcast(mode, dtype):
    ins = inputs(("bcast",), dtype, lambda q: (2, 3))
    mine = to_tf(ins[rank()], dtype)
    got = run(mode, lambda: [hvd.broadcast(mine, root) for root in range(size())])
    for root, g in enumerate(got):
        check(g, ref.broadcast(ins, root), dtype, 0, f"root {root}")


def test_broadcast_inplace_and_variables():
    n, r = size(), rank()
    root = n - 1
    v = tf.Variable(np.full((3,), float(r), np.float32))
    value = hvd.broadcast_(v, root)  # one variable: its value after the broadcast
    np.testing.assert_array_equal(value.numpy(), np.full((3,), float(root)))
    np.testing.assert_array_equal(v.numpy(), np.full((3,), float(root)))
    # A list (Horovod's form; Keras 3's variables too): the values, as a list of tensors.
    import keras

    vs = [tf.Variable([r, r + 1], dtype=tf.int32), keras.Variable(float(r) * 2)]
    values = hvd.broadcast_(vs, 0, name="bvars")
    assert [x.numpy().tolist() for x in values] == [[0, 1], 0.0]
    assert vs[0].numpy().tolist() == [0, 1] and vs[1].numpy() == 0.0
    ws = [tf.Variable(np.full((2, 2), r, np.float64)), tf.Variable([r], dtype=tf.int64)]
    hvd.broadcast_variables(ws, root_rank=root)
    np.testing.assert_array_equal(ws[0].numpy(), np.full((2, 2), root))
    assert ws[1].numpy().tolist() == [root]
    ws[1].assign([r + 10])
    hvd.broadcast_variables(ws, root_rank=0, inplace=True)
    assert ws[1].numpy().tolist() == [10]

    @tf.function
    def graph_bcast():
        hvd.broadcast_variables(ws, root_rank=root)

    ws[0].assign(np.full((2, 2), 7.0 + r))
    graph_bcast()
    np.testing.assert_array_equal(ws[0].numpy(), np.full((2, 2), 7.0 + root))


def test_broadcast_inplace_in_a_tf1_graph():
    """In a TF1 graph (Horovod's graph mode) the in-place broadcasts are ops: nothing moves until
    the session runs broadcast_'s returned values or broadcast_variables' returned op."""
    n, r = size(), rank()
    root = n - 1
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        res = tf.compat.v1.Variable(np.full((2,), float(r), np.float32), use_resource=True)
        ref = tf.compat.v1.Variable([r, r + 1], dtype=tf.int64, use_resource=False)
        sess.run(tf.compat.v1.global_variables_initializer())
        values = hvd.broadcast_([res, ref], root)
        assert sess.run(res).tolist() == [r, r]  # built, not run
        got = sess.run(values)
        assert [g.tolist() for g in got] == [[root, root], [root, root + 1]]
        assert sess.run(ref).tolist() == [root, root + 1]
        for inplace in (True, False):
            sess.run([res.assign([r + 5.0, r + 6.0]), ref.assign([r, r])])
            op = hvd.broadcast_variables([res, ref], root_rank=0, inplace=inplace)
            assert isinstance(op, tf.Operation), op
            sess.run(op)
            assert sess.run(res).tolist() == [5.0, 6.0] and sess.run(ref).tolist() == [0, 0]


def _splits(n):
    """Rank s sends (s + q) % 3 rows to rank q."""
    return [[(s + q) % 3 for q in range(n)] for s in range(n)]


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", DTYPES + ["bool"])
def test_alltoall(mode, dtype):
    n, r = size(), rank()
    splits = _splits(n)
    ins = inputs(("a2a",), dtype, lambda s: (sum(splits[s]), 2))
    mine = to_tf(ins[r], dtype)
    even = inputs(("a2a-even",), dtype, lambda s: (2 * n, 3))
    got = run(
        mode,
        lambda: (
            hvd.alltoall(mine, splits=splits[r]),
            hvd.alltoall(mine, splits=tf.constant(splits[r], tf.int32)),
            hvd.alltoall(to_tf(even[r], dtype)),
        ),
    )
    expected, received = ref.alltoall(ins, splits, r)
    for out, rsplits in got[:2]:
        check(out, expected, dtype, 0, "alltoall")
        assert rsplits.dtype == tf.int32 and rsplits.numpy().tolist() == received
    exp_even, _ = ref.alltoall(even, [[2] * n] * n, r)
    check(got[2], exp_even, dtype, 0, "alltoall even")


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter(mode, dtype):
    n, r = size(), rank()
    dim0 = 2 * n + 1  # uneven: rank 0 gets an extra row
    ins = inputs(("rs",), dtype, lambda q: (dim0, 3))
    ins2 = inputs(("rs2",), dtype, lambda q: (n + 2,))
    mine, mine2 = to_tf(ins[r], dtype), to_tf(ins2[r], dtype)
    got = run(
        mode,
        lambda: (
            hvd.reducescatter(mine, op=hvd.Sum),
            hvd.reducescatter(mine),
            hvd.grouped_reducescatter([mine, mine2], op=hvd.Sum),
            hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        ),
    )
    check(got[0], ref.reducescatter(ins, ref.SUM, dtype, r), dtype, 0, "sum")
    tol = ref.tolerance(dtype, ref.AVERAGE, n)
    check(got[1], ref.reducescatter(ins, ref.AVERAGE, dtype, r), dtype, tol, "average")
    check(got[2][0], ref.reducescatter(ins, ref.SUM, dtype, r), dtype, 0, "grouped[0]")
    check(got[2][1], ref.reducescatter(ins2, ref.SUM, dtype, r), dtype, 0, "grouped[1]")
    check(got[3], ref.reducescatter(ins, ref.SUM, dtype, r, 2.0, 0.5), dtype, 0, "scaled")


# ---- gradients ---------------------------------------------------------------------------------
def _grad(mode, x, f, upstream):
    """d/dx sum(f(x) * upstream), eagerly or inside tf.function."""

    def body():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = f(x)
        return tape.gradient(y, x, output_gradients=upstream)

    return run(mode, body).numpy()


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_gradients(mode):
    n, r = size(), rank()
    # Each rank's upstream gradient differs, so cross-rank reduction of it is visible.
    x = tf.constant(np.arange(6, dtype=np.float64).reshape(3, 2))
    ups = [np.full((3, 2), q + 1.0) for q in range(n)]
    up = tf.constant(ups[r])
    total = sum(ups)
    # allreduce: the same allreduce of the upstream gradient
    for op, expect in ((hvd.Sum, total), (hvd.Average, total / n)):
        g = _grad(mode, x, lambda t, op=op: hvd.allreduce(t, op=op), up)
        np.testing.assert_allclose(g, expect, err_msg=f"allreduce op {op}")
    g = _grad(mode, x, lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=3.0), up)
    np.testing.assert_allclose(g, 3.0 * total)
    g = _grad(mode, x, lambda t: hvd.grouped_allreduce([t, t * 2], op=hvd.Sum)[1], up)
    np.testing.assert_allclose(g, 2.0 * total)
    # allgather and broadcast: see test_allgather_and_broadcast_gradients_average
    # alltoall: rows come back along the received splits
    splits = _splits(n)
    xa = tf.constant(np.zeros((sum(splits[r]), 2)))
    recv_rows = sum(splits[s][r] for s in range(n))
    aups = [np.arange(sum(splits[s][q] for s in range(n)) * 2.0).reshape(-1, 2) + 100 * q
            for q in range(n)]  # fmt: skip
    assert aups[r].shape[0] == recv_rows
    # d/dx_r: the rows rank r sent to q are the rows q received from r, upstream of q
    expect = np.concatenate(
        [aups[q][sum(splits[s][q] for s in range(r)) :][: splits[r][q]] for q in range(n)]
    )
    g = _grad(mode, xa, lambda t: hvd.alltoall(t, splits=splits[r])[0], tf.constant(aups[r]))
    np.testing.assert_allclose(g, expect, err_msg="alltoall")
    # reducescatter: allgather of upstream, x size for Sum (Horovod's rule), x scale factors
    dim0 = 2 * n + 1
    xs = tf.constant(np.zeros((dim0, 2)))
    rs_rows = ref.reducescatter_rows(dim0, n)
    rups = [np.full((rs_rows[q], 2), q + 1.0) for q in range(n)]
    gathered = np.concatenate(rups)
    g = _grad(mode, xs, lambda t: hvd.reducescatter(t, op=hvd.Average), tf.constant(rups[r]))
    np.testing.assert_allclose(g, gathered, err_msg="reducescatter average")
    g = _grad(
        mode, xs, lambda t: hvd.reducescatter(t, op=hvd.Sum, postscale_factor=0.5),
        tf.constant(rups[r]),
    )  # fmt: skip
    np.testing.assert_allclose(g, gathered * n * 0.5, err_msg="reducescatter sum")


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_allgather_and_broadcast_gradients_average(mode):
    """Horovod 0.28.1's _allgather_grad and _broadcast_grad Average-allreduce the upstream
    gradient: allgather returns this rank's rows of the mean over ranks, broadcast the mean on
    the root and zeros elsewhere (Sum gave n times that)."""
    n, r = size(), rank()
    # Each rank's upstream gradient differs, so the mean over ranks is visible.
    rows = sum(q + 1 for q in range(n))  # rank q gathers q + 1 rows
    gups = [np.arange(rows * 2, dtype=np.float64).reshape(rows, 2) * (q + 1) for q in range(n)]
    offset = sum(q + 1 for q in range(r))
    expect = np.mean(gups, axis=0)[offset : offset + r + 1]
    xr = tf.constant(np.ones((r + 1, 2)))
    g = _grad(mode, xr, hvd.allgather, tf.constant(gups[r]))
    np.testing.assert_allclose(g, expect, rtol=1e-12, err_msg="allgather")
    g = _grad(mode, xr, lambda t: hvd.grouped_allgather([t])[0], tf.constant(gups[r]))
    np.testing.assert_allclose(g, expect, rtol=1e-12, err_msg="grouped_allgather")

    # A grouped allgather of float32 and float64 tensors: each input gets its own slice.
    x32 = tf.constant(np.ones((r + 1, 3), np.float32))
    ups32 = [np.full((rows, 3), 2.0 * (q + 1), np.float32) for q in range(n)]

    def body():
        with tf.GradientTape() as tape:
            tape.watch([xr, x32])
            a, b = hvd.grouped_allgather([xr, x32])
        return tape.gradient([a, b], [xr, x32], output_gradients=[gups[r], ups32[r]])

    g64, g32 = run(mode, body)
    np.testing.assert_allclose(g64.numpy(), expect, rtol=1e-12, err_msg="grouped[0]")
    assert g32.dtype == tf.float32
    np.testing.assert_allclose(
        g32.numpy(),
        np.mean(ups32, axis=0)[offset : offset + r + 1],
        rtol=1e-6,
        err_msg="grouped[1]",
    )

    # Horovod's test_horovod_broadcast_grad: ones upstream, for every root, in a loop whose
    # collectives must stay in step on every rank: 1 on the root, 0 elsewhere.
    for dtype in (tf.float32, tf.float64):
        x = tf.ones([5, 5], dtype) * r
        for root in range(n):
            g = _grad(mode, x, lambda t, root=root: hvd.broadcast(t, root), tf.ones([5, 5], dtype))
            np.testing.assert_allclose(g, np.full((5, 5), 1.0 if r == root else 0.0), rtol=1e-6)
    # Different upstream gradients per rank: the mean of them on the root.
    ups = [np.full((3, 2), q + 1.0) + np.arange(6).reshape(3, 2) * q for q in range(n)]
    x = tf.constant(np.arange(6, dtype=np.float64).reshape(3, 2))
    for root in range(n):
        g = _grad(mode, x, lambda t, root=root: hvd.broadcast(t, root), tf.constant(ups[r]))
        expect = np.mean(ups, axis=0) if r == root else np.zeros((3, 2))
        np.testing.assert_allclose(g, expect, rtol=1e-12, err_msg=f"broadcast root {root}")


# ---- errors ------------------------------------------------------------------------------------
def test_argument_errors():
    n = size()
    t = tf.constant([1.0, 2.0])
    for mode in MODES:
        with pytest.raises(tf.errors.InvalidArgumentError, match="Tensor type bool is not"):
            run(mode, lambda: hvd.allreduce(tf.constant([True])))
        with pytest.raises(tf.errors.InvalidArgumentError, match="Reducescatter currently only"):
            run(mode, lambda: hvd.reducescatter(t, op=hvd.Min))
        with pytest.raises(tf.errors.InvalidArgumentError, match="Number of entries in splits"):
            run(mode, lambda: hvd.alltoall(tf.ones([4]), splits=[1] * (n + 1)))
        with pytest.raises(tf.errors.InvalidArgumentError, match="Sum of splits entries is gre"):
            run(mode, lambda: hvd.alltoall(tf.ones([1]), splits=[2] * n))
        with pytest.raises(tf.errors.InvalidArgumentError, match="32-bit integer elements"):
            run(mode, lambda: hvd.alltoall(t, splits=tf.constant([2] * n, tf.int64)))
    if n > 1:
        with pytest.raises(tf.errors.InvalidArgumentError, match="splits not provided, but"):
            hvd.alltoall(tf.ones([n + 1]))
    with pytest.raises(tf.errors.InvalidArgumentError, match="invalid root rank"):
        hvd.broadcast(t, n + 5)
    with pytest.raises(ValueError, match="The op parameter supersedes average"):
        hvd.allreduce(t, average=True, op=hvd.Sum)
    if n == 3:
        with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
            hvd.allreduce(t, op=hvd.Adasum)
    # the job still works
    np.testing.assert_allclose(hvd.allreduce(t, op=hvd.Sum).numpy(), [n, 2.0 * n])


@pytest.mark.skipif("hvd.size() < 2")
def test_mismatch_errors():
    r = rank()
    shape_text = r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape \["
    with pytest.raises(tf.errors.FailedPreconditionError, match=shape_text):
        hvd.allreduce(tf.ones([3 + r]), name="mm.shape")
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched data types"):
        hvd.allreduce(tf.ones([2], dtype=tf.float32 if r else tf.int32), name="mm.dtype")
    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched reduction operation"):
        hvd.allreduce(tf.ones([2]), op=hvd.Sum if r else hvd.Max, name="mm.op")
    with pytest.raises(
        tf.errors.FailedPreconditionError,
        match="Mismatched BROADCAST root ranks: One rank specified root rank",
    ):
        hvd.broadcast(tf.ones([2]), r, name="mm.root")
    np.testing.assert_allclose(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), [size()] * 2)


@pytest.mark.skipif("hvd.size() < 2")
@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_mismatch_errors_in_tf_function(monkeypatch, path):
    """Inside tf.function the same classes and texts as eagerly: the collectives fail in their
    kernel ("kernel"), or ("numpy") the numpy_function path hands its status to the
    BaguaHvdRaise op (bagua_hvd/tensorflow/kernels.py).
    The tests require the kernels to build here. Without them (the fallback) TensorFlow reports
    UnknownError with the text."""
    r = rank()
    shape_text = r"Mismatched ALLREDUCE tensor shapes: One rank sent a tensor of shape \["
    assert hvd.mpi_ops._kernels.load() is not None, "bagua_hvd's TensorFlow kernels did not build"
    monkeypatch.setattr(hvd.mpi_ops, "_collective_kernel", [path == "kernel"])
    cases = [
        (lambda: hvd.allreduce(tf.ones([3 + r]), name="g.shape"), shape_text),
        (
            lambda: hvd.allreduce(tf.ones([2], dtype=tf.float32 if r else tf.int32), name="g.dt"),
            "Mismatched data types",
        ),
        (
            lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum if r else hvd.Max, name="g.op"),
            "Mismatched reduction operation",
        ),
        (lambda: hvd.broadcast(tf.ones([2]), r, name="g.root"), "Mismatched BROADCAST root"),
        (
            lambda: hvd.allgather(tf.ones([2, 1 + r]), name="g.gather"),
            "Mismatched ALLGATHER tensor shapes",
        ),
        (
            lambda: hvd.alltoall(tf.ones([2 * size(), 1 + r]), name="g.a2a"),
            "Mismatched ALLTOALL tensor shapes",
        ),
        (
            lambda: hvd.reducescatter(tf.ones([2 * size(), 1 + r]), name="g.rs"),
            "Mismatched REDUCESCATTER tensor shapes",
        ),
    ]
    for fn, text in cases:
        with pytest.raises(tf.errors.FailedPreconditionError, match=text):
            tf.function(fn)()
    with pytest.raises(tf.errors.InvalidArgumentError, match="invalid root rank"):
        tf.function(lambda: hvd.broadcast(tf.ones([2]), size() + 5))()
    np.testing.assert_allclose(
        tf.function(lambda: hvd.allreduce(tf.ones([2]), op=hvd.Sum))().numpy(), [size()] * 2
    )
    # The fallback where the kernels cannot be built.
    monkeypatch.setattr(hvd.mpi_ops._kernels, "_loaded", [None])
    f = tf.function(lambda: hvd.allreduce(tf.ones([3 + r]), name="g.fallback"))
    with pytest.raises(tf.errors.UnknownError, match="FailedPreconditionError: " + shape_text):
        f()
    np.testing.assert_allclose(hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy(), [size()] * 2)


def test_graph_paths():
    """Which path each collective takes inside tf.function: the asynchronous kernels, or with
    them switched off a numpy_function + BaguaHvdRaise each, numpy_function only without the
    library."""

    def op_types(flag, loaded=None):
        old = hvd.mpi_ops._collective_kernel[0], list(hvd.mpi_ops._kernels._loaded)
        hvd.mpi_ops._collective_kernel[0] = flag
        if loaded is not None:
            hvd.mpi_ops._kernels._loaded[:] = loaded
        try:
            f = tf.function(
                lambda x: (
                    hvd.grouped_allreduce([x, x * 2]),
                    hvd.broadcast(x, 0),
                    hvd.allgather(x),
                    hvd.alltoall(x),
                    hvd.reducescatter(x),
                )
            )
            graph = f.get_concrete_function(tf.TensorSpec([3 * size()], tf.float32)).graph
            return [op.type for op in graph.get_operations()]
        finally:
            hvd.mpi_ops._collective_kernel[0] = old[0]
            hvd.mpi_ops._kernels._loaded[:] = old[1]

    types = op_types(True)
    assert types.count("BaguaHvdCollective") == 2, types
    assert types.count("BaguaHvdAllgather") == 1 and types.count("BaguaHvdAlltoall") == 1, types
    assert types.count("BaguaHvdReducescatter") == 1, types
    assert "PyFunc" not in types and "BaguaHvdRaise" not in types, types
    types = op_types(False)
    assert not [t for t in types if t.startswith("BaguaHvd") and t != "BaguaHvdRaise"], types
    assert types.count("PyFunc") == 5 and types.count("BaguaHvdRaise") == 5, types
    types = op_types(True, loaded=[None])
    assert not [t for t in types if t.startswith("BaguaHvd")], types
    assert types.count("PyFunc") == 5, types


def test_kernels_keep_a_fixed_number_of_threads():
    """Hundreds of kernel collectives do not grow the process's threads (the kernels' watchdog
    is one thread per process; a thread per op once livelocked a job after thousands)."""

    def threads() -> int:
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Threads:")).split()[1])

    f = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, name="threads"))
    x = tf.ones([4])
    for _ in range(20):  # warm-up: TensorFlow's pools start their threads lazily
        f(x)
    before = threads()
    for _ in range(300):
        f(x)
    assert threads() - before <= 2, f"{before} threads before, {threads()} after 300 ops"


@pytest.mark.skipif("hvd.size() < 2")
def test_kernel_timeout_and_late_completion(monkeypatch, capfd):
    """The kernel waits for no collective forever: with BAGUA_HVD_OP_TIMEOUT_SECONDS a
    collective the other ranks have not submitted fails the step with DeadlineExceeded and
    Horovod's text (after BAGUA_HVD_WAIT_WARNING_SECONDS' warning); when the others submit it
    later it completes and is freed, and the job goes on."""
    r = rank()
    x = tf.fill([1000], tf.constant(float(r + 1)))
    if r == 0:  # (the others' barrier below waits for it under the job's limits)
        monkeypatch.setenv("BAGUA_HVD_OP_TIMEOUT_SECONDS", "3")
        monkeypatch.setenv("BAGUA_HVD_WAIT_WARNING_SECONDS", "1")
        f = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum, name="lonely"))
        with pytest.raises(
            tf.errors.DeadlineExceededError,
            match=r"allreduce.lonely \(handle \d+\) did not complete within "
            r"BAGUA_HVD_OP_TIMEOUT_SECONDS=3 s: other ranks may not have submitted",
        ):
            f()
        assert "bagua_hvd: still waiting for allreduce.lonely" in capfd.readouterr().err
        monkeypatch.undo()
    hvd.mpi_ops.barrier()
    total = sum(q + 1 for q in range(size()))
    if r != 0:  # the late partners: rank 0's request completes now, after its step failed
        got = hvd.allreduce(x, op=hvd.Sum, name="lonely")
        np.testing.assert_allclose(got.numpy(), np.full(1000, float(total)))
    hvd.mpi_ops.barrier()
    got = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum, name="after"))()
    np.testing.assert_allclose(got.numpy(), np.full(1000, float(total)))


# ---- join, barrier, objects, process sets ------------------------------------------------------
def test_join_barrier_objects():
    n, r = size(), rank()
    last = hvd.join()
    assert last.dtype == tf.int32 and 0 <= int(last) < n
    assert int(tf.function(hvd.join)()) in range(n)
    hvd.mpi_ops.barrier()
    obj = {"rank": r, "data": [1, 2, r]}
    assert hvd.broadcast_object(obj, root_rank=n - 1) == {"rank": n - 1, "data": [1, 2, n - 1]}
    assert hvd.broadcast_object_fn(root_rank=0)(obj)["rank"] == 0
    assert hvd.allgather_object(("x", r)) == [("x", q) for q in range(n)]


def test_object_helpers_in_tf_function_and_tf1_graphs():
    """broadcast_object, broadcast_object_fn and allgather_object inside tf.function (run at
    trace time: the objects become constants of the graph, between collectives that run in it)
    and in a TF1 graph through a session (Horovod's graph mode)."""
    n, r = size(), rank()
    obj = {"rank": r, "data": [1, 2, r]}
    expected_obj = {"rank": n - 1, "data": [1, 2, n - 1]}
    expected_all = [("x", q, {"q": [q] * q}) for q in range(n)]
    traced = []

    @tf.function
    def step(x):
        before = hvd.allreduce(x, op=hvd.Sum, name="obj.before")
        got = hvd.broadcast_object(obj, root_rank=n - 1)
        got_fn = hvd.broadcast_object_fn(root_rank=0, name="objfn")(obj)
        gathered = hvd.allgather_object(("x", r, {"q": [r] * r}))
        traced.append((got, got_fn, gathered))
        after = hvd.allreduce(x + got["rank"] + len(gathered), op=hvd.Sum, name="obj.after")
        return before, after

    for _ in range(2):  # traced once: the second call runs only the graph's collectives
        before, after = step(tf.constant([float(r), 1.0]))
        total = sum(range(n))
        np.testing.assert_array_equal(before.numpy(), [total, n])
        np.testing.assert_array_equal(after.numpy(), [total + n * (n - 1 + n), n * (2 * n)])
    assert len(traced) == 1
    got, got_fn, gathered = traced[0]
    assert got == expected_obj
    assert got_fn == {"rank": 0, "data": [1, 2, 0]}
    assert gathered == expected_all

    with tf.Graph().as_default():
        with pytest.raises(ValueError, match="need a session"):  # on every rank, before any op
            hvd.broadcast_object(obj, root_rank=0)
        with tf.compat.v1.Session() as sess:
            assert hvd.broadcast_object(obj, root_rank=n - 1) == expected_obj
            assert hvd.allgather_object(("x", r, {"q": [r] * r})) == expected_all
        with tf.compat.v1.Session() as sess:
            assert hvd.broadcast_object(obj, root_rank=0, session=sess)["rank"] == 0
            assert hvd.allgather_object(r, session=sess) == list(range(n))
    assert hvd.allgather_object(r) == list(range(n))  # eagerly again


@contextlib.contextmanager
def dynamic_process_sets():
    """Horovod re-initialized with HOROVOD_DYNAMIC_PROCESS_SETS=1 for the block, then as before."""
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.mpi_ops.barrier()
    hvd.shutdown()
    hvd.init()
    try:
        yield
    finally:
        os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
        hvd.mpi_ops.barrier()
        hvd.shutdown()
        hvd.init()


@pytest.mark.handles_may_diverge
def test_process_sets():
    n, r = size(), rank()
    with dynamic_process_sets():
        if n == 1:
            with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
                hvd.add_process_set([0])
            return
        evens = hvd.add_process_set(list(range(0, n, 2)))
        members = evens.ranks
        assert int(hvd.process_set_included_op(evens.process_set_id)) == int(r in members)
        if r in members:
            k, idx = len(members), members.index(r)
            assert int(hvd.size_op(evens.process_set_id)) == k
            ins = inputs(("ps",), "float32", lambda q: (2, 3))
            mine = to_tf(ins[members[idx]], "float32")
            sub = [ins[m] for m in members]
            for mode in KERNEL_MODES:
                got = run(
                    mode,
                    lambda: (
                        hvd.allreduce(mine, op=hvd.Sum, process_set=evens, name="ps.ar"),
                        hvd.allgather(mine, process_set=evens, name="ps.ag"),
                        hvd.broadcast(mine, members[-1], process_set=evens, name="ps.bc"),
                        hvd.reducescatter(mine, op=hvd.Sum, process_set=evens, name="ps.rs"),
                    ),
                )
                check(got[0], ref.allreduce(sub, ref.SUM, "float32"), "float32", 0, "ps ar")
                check(got[1], ref.allgather(sub), "float32", 0, "ps ag")
                check(got[2], sub[-1], "float32", 0, "ps bc")
                check(got[3], ref.reducescatter(sub, ref.SUM, "float32", idx), "float32")
            if n > 2:  # Adasum needs the global set
                with pytest.raises(NotImplementedError, match="non-global process sets"):
                    hvd.allreduce(mine, op=hvd.Adasum, process_set=evens)
        else:
            with pytest.raises(
                tf.errors.InvalidArgumentError,
                match=f"Allreduce: Rank {r} is not a member of the provided process set.",
            ):
                hvd.allreduce(tf.ones([2]), process_set=evens, name="ps.nm")
            for fn in (
                lambda: hvd.allreduce(tf.ones([2]), process_set=evens, name="ps.nm.g"),
                lambda: hvd.reducescatter(tf.ones([4]), process_set=evens, name="ps.nm.rs"),
                lambda: hvd.allgather(tf.ones([4]), process_set=evens, name="ps.nm.ag"),
            ):
                with pytest.raises(
                    tf.errors.InvalidArgumentError,
                    match=f"Rank {r} is not a member of the provided process set",
                ):
                    tf.function(fn)()
        hvd.mpi_ops.barrier()
        assert hvd.remove_process_set(evens)


def test_util_helpers():
    """horovod.tensorflow.util's helpers, which scripts and Horovod's tests use."""
    import keras

    from bagua_hvd.tensorflow import util

    assert hvd.util is util and util._executing_eagerly() is True
    assert tf.function(lambda: tf.constant(util._executing_eagerly()))().numpy() == False  # noqa: E712
    v, k = tf.Variable(1.0), keras.Variable(2.0)
    refs = util.vars_to_refs([v, [k]])
    hash(refs)
    back = util.refs_to_vars(refs)
    assert back[0] is v and float(back[1][0].numpy()) == 2.0
    calls = []
    cached = util._cache(lambda x: calls.append(x) or [x])
    assert cached(1) is cached(1) and calls == [1]
    assert float(util._make_subgraph(lambda: tf.constant(3.0))()) == 3.0
    # horovod.tensorflow also exports horovod.common.util's helpers (Horovod's Adasum tests call
    # hvd.gpu_available("tensorflow")).
    assert hvd.gpu_available("tensorflow") == bool(tf.config.list_physical_devices("GPU"))
    assert hvd.split_list([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]


@pytest.mark.handles_may_diverge
def test_unnamed_eager_ops_match_per_process_set():
    """Unnamed eager ops match in call order per op type and process set, as Horovod's eager
    kernels (all named after their op type) do: ranks that skip an op of a set they are not in
    (Horovod's DistributedOptimizer does, for example) still meet the others in the next
    global op. (Numbered per process, the global op's names would differ: a stall.)"""
    n, r = size(), rank()
    if n == 1:
        pytest.skip("needs ranks outside the set")
    with dynamic_process_sets():
        evens = hvd.add_process_set(list(range(0, n, 2)))
        # Horovod's internal view (its process-set tests read it), and its error for an id
        # the core does not know, raised by allreduce before any op.
        assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {
            0: list(range(n)),
            evens.process_set_id: list(range(0, n, 2)),
        }
        fake = hvd.ProcessSet([0])
        fake.process_set_id = 4242
        for fn in (
            hvd.allreduce,
            lambda t, process_set: hvd.grouped_allreduce([t], process_set=process_set),
        ):
            with pytest.raises(
                ValueError, match="Process set does not exist or has not been registered."
            ):
                fn(tf.ones([2]), process_set=fake)
        for step in range(2):
            if r in evens.ranks:
                got = hvd.allreduce(tf.constant([float(r + step)]), op=hvd.Sum, process_set=evens)
                assert float(got[0]) == sum(m + step for m in evens.ranks)
            got = hvd.allreduce(tf.constant([float(r + 1)]), op=hvd.Sum)
            assert float(got[0]) == n * (n + 1) / 2
            got = hvd.allgather(tf.constant([r]))
            assert got.numpy().tolist() == list(range(n))
        hvd.mpi_ops.barrier()
        assert hvd.remove_process_set(evens)


@pytest.mark.parametrize("mode", MODES)
def test_pooled_outputs_stay_valid_while_referenced(mode):
    """Outputs of 64 KiB and more come from a buffer pool (bagua_hvd/tensorflow/mpi_ops.py):
    a buffer must not be handed out again while a tensor, or a numpy view of one, still uses
    it, and the outputs must hold the right values after later calls of the same size."""
    n = 1 << 16  # float32: 256 KiB

    def reduce(value: float) -> tf.Tensor:
        x = tf.fill([n], tf.constant(value * (rank() + 1), tf.float32))
        return hvd.allreduce(x, op=hvd.Sum, name="pooled")

    fn = tf.function(reduce) if mode == "graph" else reduce
    total = sum(r + 1 for r in range(size()))
    kept = fn(1.0)
    view = fn(2.0).numpy()  # the tensor is gone after this line, its numpy copy/view stays
    later = [fn(3.0 + i) for i in range(4)]  # same size: would reuse a wrongly freed buffer
    np.testing.assert_array_equal(kept.numpy(), np.full(n, 1.0 * total, np.float32))
    np.testing.assert_array_equal(view, np.full(n, 2.0 * total, np.float32))
    for i, t in enumerate(later):
        np.testing.assert_array_equal(t.numpy(), np.full(n, (3.0 + i) * total, np.float32))
    del kept, later
    again = fn(9.0)  # buffers given back to the pool are reused correctly
    np.testing.assert_array_equal(again.numpy(), np.full(n, 9.0 * total, np.float32))


def test_kernels_take_gpu_tensors_through_host_memory():
    """GPU builds of TensorFlow place the collectives on the GPU with every argument in host
    memory (TensorFlow copies around them; docs/gpu.md); the algorithms' variable kernels stay
    on the CPU. The reference: each op's own argument list."""
    from tensorflow.python.framework import kernels as registered
    from tensorflow.python.framework import op_def_registry

    from bagua_hvd.tensorflow import kernels

    assert kernels.load() is not None
    for op in ("Collective", "Reducescatter", "Allgather", "Alltoall", "Raise", "Counter",
               "Buckets", "LpInit"):  # fmt: skip
        name = f"BaguaHvd{op}"
        op_def = op_def_registry.get(name)
        args = sorted(a.name for a in list(op_def.input_arg) + list(op_def.output_arg))
        by_device = {k.device_type: sorted(k.host_memory_arg)
                     for k in registered.get_registered_kernels_for_op(name).kernel}  # fmt: skip
        assert by_device.get("CPU") == [], (name, by_device)
        if op == "LpInit":
            assert "GPU" not in by_device, (name, by_device)
        else:
            assert by_device.get("GPU") == args, (name, by_device, args)
