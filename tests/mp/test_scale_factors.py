"""Pre- and post-scaling give Horovod's results bit for bit, in torch and in TensorFlow.

Horovod's ScaleBuffer scales a float tensor in its own dtype (the factor cast to it first),
float16 in float32 and back, an integer in float64 truncated toward zero; prescale before the
reduction, postscale (divided by the size for Average) after it. Its own tests compare with
exact equality at up to 3 ranks, on inputs that are the same on every rank. So do these, against
tests/reference.py's ``allreduce_exact`` (numpy in each dtype's arithmetic).

Runs inside a launched job (tests/test_torch_ops.py starts it at 1, 2 and 3 ranks).
"""

from __future__ import annotations

import numpy as np
import pytest
import reference as ref
import torch
from helpers import REDUCE_DTYPES, to_numpy, to_torch

import bagua_hvd.torch as hvd

# Horovod's test draws its factor with np.random.seed(1234); 1/3 and 1.37 are inexact too.
FACTORS = [(0.1915194503788923, 1.0), (1.0, 1 / 3), (1.37, 0.1915194503788923)]
SHAPES = [(17,), (17, 17, 17)]  # the second one runs the vector loops and their tails
RANGES = {"uint8": (0, 60), "int8": (-30, 30)}  # 3 ranks' sums stay in range


def same_inputs(case: tuple, dtype: str, shape: tuple) -> list:
    """One input, the same on every rank (the order of the ranks' sum cannot matter)."""
    low, high = RANGES.get(dtype, (-100, 99))
    a = ref.make_input(ref.seed_for(*case, dtype), 0, shape, dtype, low, high)
    return [a] * hvd.size()


def assert_bits(got: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Equal bit for bit (so -0.0 != 0.0, and NaN payloads count)."""
    e = np.ascontiguousarray(expected.astype(got.dtype))
    g = np.ascontiguousarray(got)
    assert g.shape == e.shape, f"{what}: {g.shape} != {e.shape}"
    bits = np.dtype(f"u{g.dtype.itemsize}")
    bad = np.flatnonzero(g.view(bits) != e.view(bits))
    if bad.size:
        i = int(bad[0])
        raise AssertionError(
            f"{what}: {bad.size} element(s) differ, first at flat index {i}: "
            f"got {g.flat[i]!r}, Horovod's formula gives {e.flat[i]!r}"
        )


def check_torch(got: torch.Tensor, expected: np.ndarray, dtype: str, what: str) -> None:
    assert got.dtype == to_torch(expected[:0], dtype).dtype, f"{what}: dtype {got.dtype}"
    assert_bits(to_numpy(got), expected, what)


def cases():
    for dtype in REDUCE_DTYPES:
        for op in (hvd.Sum, hvd.Average):
            for pre, post in FACTORS:
                yield dtype, op, pre, post


@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
def test_torch_allreduce_forms(dtype):
    for _, op, pre, post in (c for c in cases() if c[0] == dtype):
        for shape in SHAPES:
            inputs = same_inputs(("ar", op, pre, post, shape), dtype, shape)
            expected = ref.allreduce_exact(inputs, op, dtype, pre, post)
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
            what = f"{dtype} op={op} pre={pre} post={post} {shape}"
            t = to_torch(inputs[hvd.rank()], dtype)
            check_torch(hvd.allreduce(t, **kw), expected, dtype, "allreduce " + what)
            hvd.allreduce_(t, **kw)
            check_torch(t, expected, dtype, "allreduce_ " + what)
            t = to_torch(inputs[hvd.rank()], dtype)
            out = hvd.synchronize(hvd.allreduce_async(t, **kw))
            check_torch(out, expected, dtype, "allreduce_async " + what)
            # fused: two tensors in one request
            group = hvd.grouped_allreduce([t, t[: len(t) // 2].clone()], **kw)
            check_torch(group[0], expected, dtype, "grouped_allreduce[0] " + what)
            check_torch(group[1], expected[: len(t) // 2], dtype, "grouped_allreduce[1] " + what)


@pytest.mark.parametrize("dtype", REDUCE_DTYPES)
def test_torch_reducescatter(dtype):
    for _, op, pre, post in (c for c in cases() if c[0] == dtype):
        for shape in SHAPES:
            inputs = same_inputs(("rs", op, pre, post, shape), dtype, shape)
            expected = ref.reducescatter_exact(inputs, op, dtype, hvd.rank(), pre, post)
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
            what = f"{dtype} op={op} pre={pre} post={post} {shape}"
            t = to_torch(inputs[hvd.rank()], dtype)
            check_torch(hvd.reducescatter(t, **kw), expected, dtype, "reducescatter " + what)
            outs = hvd.grouped_reducescatter([t, t.clone()], **kw)
            for o in outs:
                check_torch(o, expected, dtype, "grouped_reducescatter " + what)


# ---- TensorFlow: eagerly, in tf.function through the kernels and through numpy_function -----
# One dtype per rule (integer, 16-bit float, float32, float64): tracing dominates the cost, and
# the torch tests above cover every dtype of the shared core.
TF_DTYPES = ["int32", "float16", "float32", "float64"]


def tf_run(mode, fn):
    tf = pytest.importorskip("tensorflow")
    import bagua_hvd.tensorflow as hvd_tf

    if mode == "eager":
        return fn()
    if mode == "graph":
        return tf.function(fn)()
    hvd_tf.mpi_ops._collective_kernel[0] = False
    try:
        return tf.function(fn)()
    finally:
        hvd_tf.mpi_ops._collective_kernel[0] = True


def tf_numpy(t) -> np.ndarray:
    import tensorflow as tf

    return (tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t).numpy()


@pytest.mark.parametrize("mode", ["eager", "graph", "graph-numpy"])
@pytest.mark.parametrize("dtype", TF_DTYPES)
def test_tf_scaled_collectives(dtype, mode):
    tf = pytest.importorskip("tensorflow")
    import bagua_hvd.tensorflow as hvd_tf

    hvd_tf.init()
    tf_dtype = tf.bfloat16 if dtype == "bfloat16" else tf.as_dtype(dtype)
    combos = [(op, pre, post) for op in (hvd_tf.Sum, hvd_tf.Average) for pre, post in FACTORS]
    inputs = same_inputs(("tf", mode), dtype, SHAPES[1])
    x = tf.cast(tf.constant(inputs[hvd.rank()].astype(np.float32)), tf_dtype)

    def collectives():  # one trace for every combination (tracing dominates the cost)
        outs = []
        for op, pre, post in combos:
            kw = dict(op=op, prescale_factor=pre, postscale_factor=post)
            outs.append((
                hvd_tf.allreduce(x, **kw),
                hvd_tf.grouped_allreduce([x, x[:5]], **kw),
                hvd_tf.reducescatter(x, **kw),
                hvd_tf.grouped_reducescatter([x], **kw),
            ))  # fmt: skip
        return outs

    for (op, pre, post), (ar, (g0, g1), rs, (gr0,)) in zip(combos, tf_run(mode, collectives)):
        # Horovod's TF ops take the factors as float32 attributes.
        pre32, post32 = float(np.float32(pre)), float(np.float32(post))
        expected = ref.allreduce_exact(inputs, op, dtype, pre32, post32)
        rows = ref.reducescatter_exact(inputs, op, dtype, hvd.rank(), pre32, post32)
        what = f"{mode} {dtype} op={op} pre={pre} post={post}"
        for got, exp, name in ((ar, expected, "allreduce"), (g0, expected, "grouped[0]"),
                               (g1, expected[:5], "grouped[1]"), (rs, rows, "reducescatter"),
                               (gr0, rows, "grouped_reducescatter")):  # fmt: skip
            assert got.dtype == tf_dtype, f"{name} {what}: {got.dtype}"
            assert_bits(tf_numpy(got), exp, f"{name} {what}")


@pytest.mark.parametrize("mode", ["eager", "graph", "graph-numpy"])
def test_tf_refuses_non_finite_factors_and_int32_overflowing_roots(mode):
    tf = pytest.importorskip("tensorflow")
    import bagua_hvd.tensorflow as hvd_tf

    x = tf.ones([hvd.size(), 2])
    for bad in (float("nan"), float("inf")):
        for key in ("prescale_factor", "postscale_factor"):
            for fn in (hvd_tf.allreduce, hvd_tf.reducescatter):
                with pytest.raises(ValueError, match=f"{key} must be a finite number, got {bad}"):
                    tf_run(mode, lambda fn=fn, key=key, bad=bad: fn(x, op=hvd_tf.Sum, **{key: bad}))
    for root in (2**31, -(2**31) - 1):
        text = f"broadcast received invalid root rank {root} for provided process set"
        with pytest.raises(tf.errors.InvalidArgumentError, match=text):
            tf_run(mode, lambda root=root: hvd_tf.broadcast(x, root_rank=root))
    assert tf_numpy(tf_run(mode, lambda: hvd_tf.allreduce(x, op=hvd_tf.Sum)))[0, 0] == hvd.size()
