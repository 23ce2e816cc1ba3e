"""bagua_hvd.tensorflow.DistributedGradientTape / PartialDistributedGradientTape.

Runs inside a launched job (tests/test_tf_tape.py starts it at 1, 2 and 3 ranks). Every rank
trains a tiny MLP written with tf ops on its own batch; all batches come from per-rank seeds, so
each rank can also compute the single-process reference: plain tf.GradientTape gradients of the
loss over the concatenation of every rank's batch (the mean loss over equal-sized batches has the
mean of the per-rank gradients as its gradient).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tape_requests import spy_grouped_requests  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402

MODES = ["eager", "graph"]
D_IN, D_HID, D_OUT, BATCH, VOCAB = 5, 7, 3, 4, 11
RTOL, ATOL = 1e-5, 1e-9


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


def size():
    return hvd.size()


def rank():
    return hvd.rank()


# ---- model and data ----------------------------------------------------------------------------
def make_vars(dtype=tf.float64, seed=7):
    rng = np.random.default_rng(seed)
    shapes = {"w1": (D_IN, D_HID), "b1": (D_HID,), "w2": (D_HID, D_OUT), "b2": (D_OUT,)}
    return {k: tf.Variable(rng.normal(0, 0.5, s), dtype=dtype, name=k) for k, s in shapes.items()}


def batch(r, step, dtype=np.float64):
    rng = np.random.default_rng(1000 * r + step + 1)
    x = rng.normal(0, 1, (BATCH, D_IN)).astype(dtype)
    y = rng.normal(0, 1, (BATCH, D_OUT)).astype(dtype)
    return x, y


def all_batches(step, dtype=np.float64):
    xs, ys = zip(*[batch(r, step, dtype) for r in range(size())])
    return np.concatenate(xs), np.concatenate(ys)


def loss_fn(v, x, y):
    h = tf.tanh(tf.matmul(x, v["w1"]) + v["b1"])
    out = tf.matmul(h, v["w2"]) + v["b2"]
    return tf.reduce_mean(tf.reduce_sum((out - y) ** 2, axis=1))


def order(v):
    return [v["w1"], v["b1"], v["w2"], v["b2"]]


def reference_grads(v, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(v, x, y)
    return tape.gradient(loss, order(v))


def assert_close(got, expected, rtol=RTOL, atol=ATOL, what=""):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        g = tf.convert_to_tensor(g).numpy()
        e = tf.convert_to_tensor(e).numpy()
        assert g.shape == e.shape, f"{what}[{i}]: {g.shape} != {e.shape}"
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{what}[{i}]")


def dist_grads(mode, v, x, y, **kw):
    """DistributedGradientTape gradients of this rank's loss, eagerly or in a tf.function."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, y)
        tape = hvd.DistributedGradientTape(tape, **kw)
        return tape.gradient(loss, order(v))

    fn = step if mode == "eager" else tf.function(step)
    return fn(tf.constant(x), tf.constant(y))


# ---- tests -------------------------------------------------------------------------------------
def test_exports_and_type():
    for name in ("DistributedGradientTape", "PartialDistributedGradientTape"):
        assert callable(getattr(hvd, name)), name
    with tf.GradientTape() as tape:
        pass
    wrapped = hvd.DistributedGradientTape(tape)
    assert isinstance(wrapped, tf.GradientTape)
    assert type(wrapped).__name__ == "GradientTape"
    assert hvd.rank() == rank()


@pytest.mark.parametrize("mode", MODES)
def test_sgd_equivalence(mode):
    """N SGD steps with the tape on per-rank batches == N steps on the concatenated batches."""
    dist, ref = make_vars(), make_vars()
    lr = 0.1

    def dist_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(dist, x, y)
        tape = hvd.DistributedGradientTape(tape)
        for var, g in zip(order(dist), tape.gradient(loss, order(dist))):
            var.assign_sub(lr * g)
        return loss

    fn = dist_step if mode == "eager" else tf.function(dist_step)
    for step in range(5):
        x, y = batch(rank(), step)
        fn(tf.constant(x), tf.constant(y))
        xa, ya = all_batches(step)
        for var, g in zip(order(ref), reference_grads(ref, xa, ya)):
            var.assign_sub(lr * g)
    assert_close(order(dist), order(ref), what=f"variables after 5 steps ({mode})")
    # The ranks did diverge from the initial values (the test is not vacuous).
    assert not np.allclose(dist["w1"].numpy(), make_vars()["w1"].numpy())


@pytest.mark.parametrize("mode", MODES)
def test_op_sum_and_predivide(mode, monkeypatch):
    v = make_vars()
    x, y = batch(rank(), 0)
    mean = reference_grads(v, *all_batches(0))
    got = dist_grads(mode, v, x, y, op=hvd.Sum)
    assert_close(got, [g * size() for g in mean], what="op=Sum")
    calls = []
    spy_grouped_requests(monkeypatch, hvd, lambda ts, op, pre, post: calls.append((pre, post, op)))
    got = dist_grads(mode, v, x, y, gradient_predivide_factor=4.0)
    assert_close(got, mean, what="gradient_predivide_factor=4")
    # Horovod splits the averaging: prescale 1/f, postscale f (then / size by Average).
    assert calls == ([] if size() == 1 else [(0.25, 4.0, hvd.Average)])


@pytest.mark.parametrize("mode", MODES)
def test_groups(mode, monkeypatch):
    v = make_vars()
    x, y = batch(rank(), 1)
    mean = reference_grads(v, *all_batches(1))
    seen = []
    spy_grouped_requests(
        monkeypatch, hvd, lambda ts, *_: seen.append(tuple(tuple(t.shape) for t in ts))
    )
    s = {k: tuple(t.shape) for k, t in v.items()}
    cases = [
        ({}, [(s["w1"], s["b1"], s["w2"], s["b2"])]),  # default: one fused request
        ({"groups": 2}, [(s["w1"], s["b1"]), (s["w2"], s["b2"])]),
        ({"groups": [[v["w2"], v["w1"]], [v["b1"]]]}, [(s["w2"], s["w1"]), (s["b1"],), (s["b2"],)]),
    ]
    for kw, expected in cases:
        seen.clear()
        got = dist_grads(mode, v, x, y, **kw)
        assert_close(got, mean, what=f"groups {kw}")
        assert seen == ([] if size() == 1 else expected), kw


def test_num_groups_deprecated(monkeypatch):
    seen = []
    spy_grouped_requests(monkeypatch, hvd, lambda ts, *_: seen.append(len(ts)))
    v = make_vars()
    x, y = batch(rank(), 2)
    with pytest.warns(DeprecationWarning, match="replaced by `groups`"):
        got = dist_grads("eager", v, x, y, num_groups=3)
    assert_close(got, reference_grads(v, *all_batches(2)), what="num_groups=3")
    assert seen == ([] if size() == 1 else [2, 1, 1])  # Horovod's split_list of 4 into 3


def sparse_model(seed=3):
    rng = np.random.default_rng(seed)
    emb = tf.Variable(rng.normal(0, 1, (VOCAB, 4)), dtype=tf.float64, name="emb")
    w = tf.Variable(rng.normal(0, 1, (4, 2)), dtype=tf.float64, name="w")
    return emb, w


def sparse_batch(r):
    rng = np.random.default_rng(500 + r)
    ids = rng.integers(0, VOCAB, size=6)
    ids[1] = ids[0]  # a repeated id: its rows must add up
    y = rng.normal(0, 1, (6, 2))
    return ids.astype(np.int64), y


def sparse_loss(emb, w, ids, y):
    return tf.reduce_mean((tf.matmul(tf.gather(emb, ids), w) - y) ** 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(mode, sparse_as_dense):
    emb, w = sparse_model()
    ids, y = sparse_batch(rank())

    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = sparse_loss(emb, w, ids, y)
        tape = hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense)
        return tape.gradient(loss, [emb, w])

    fn = step if mode == "eager" else tf.function(step)
    g_emb, g_w = fn(tf.constant(ids), tf.constant(y))
    if sparse_as_dense:
        assert isinstance(g_emb, tf.Tensor), type(g_emb)
    else:
        assert isinstance(g_emb, tf.IndexedSlices), type(g_emb)
        # The allgather path: every rank's rows (6 per rank).
        assert int(tf.shape(g_emb.values)[0]) == 6 * size()
    all_ids = np.concatenate([sparse_batch(r)[0] for r in range(size())])
    all_y = np.concatenate([sparse_batch(r)[1] for r in range(size())])
    with tf.GradientTape() as tape:
        loss = sparse_loss(emb, w, all_ids, all_y)
    ref = [tf.convert_to_tensor(g) for g in tape.gradient(loss, [emb, w])]
    assert_close([tf.convert_to_tensor(g_emb), g_w], ref, what=f"sparse {sparse_as_dense}")


@pytest.mark.parametrize("mode", MODES)
def test_none_gradients(mode):
    v = make_vars()
    unused = tf.Variable(np.ones(3), dtype=tf.float64, name="unused")
    x, y = batch(rank(), 3)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, y)
        tape = hvd.DistributedGradientTape(tape)
        return tape.gradient(loss, [v["w1"], unused, v["b1"], v["w2"], v["b2"]])

    fn = step if mode == "eager" else tf.function(step)
    got = fn(tf.constant(x), tf.constant(y))
    assert got[1] is None
    assert_close([got[0], *got[2:]], reference_grads(v, *all_batches(3)), what="with None")

    def only_unused(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, y)
        return hvd.DistributedGradientTape(tape).gradient(loss, [unused])

    fn = only_unused if mode == "eager" else tf.function(only_unused)
    assert fn(tf.constant(x), tf.constant(y)) == [None]


@pytest.mark.parametrize(
    "compression,tol", [(hvd.Compression.fp16, 2e-3), (hvd.Compression.bf16, 2e-2)]
)
@pytest.mark.parametrize("mode", MODES)
def test_compression(mode, compression, tol):
    """float32 gradients cast to fp16 (11-bit mantissa) or bf16 (8-bit) for the sum: the result
    is float32 and within ``tol`` x max|g| of the exact mean."""
    v = make_vars(tf.float32)
    x, y = batch(rank(), 4, np.float32)
    xa, ya = all_batches(4, np.float32)
    mean = reference_grads(v, xa, ya)
    got = dist_grads(mode, v, x, y, compression=compression)
    for g, e in zip(got, mean):
        assert g.dtype == tf.float32
        scale = float(np.max(np.abs(e.numpy())))
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=0, atol=tol * scale)
    if size() > 1:  # the wire really is narrower: not bit-identical to the float32 result
        exact = dist_grads(mode, v, x, y)
        assert any(not np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got, exact))


class Holder(tf.Module):
    def __init__(self, variables):
        super().__init__()
        self.vs = list(variables)


@pytest.mark.parametrize("mode", MODES)
def test_partial_tape(mode):
    """Local layers' gradients are this rank's own, divided by the size (scale_local_gradients);
    the others are averaged."""
    v = make_vars()
    x, y = batch(rank(), 5)
    local = Holder([v["w2"]])

    def step(x, y, scale):
        with tf.GradientTape() as tape:
            loss = loss_fn(v, x, y)
        tape = hvd.PartialDistributedGradientTape(
            tape, local_layers=local, scale_local_gradients=scale
        )
        return tape.gradient(loss, order(v))

    for scale in (True, False):
        fn = step if mode == "eager" else tf.function(step)
        got = fn(tf.constant(x), tf.constant(y), scale)
        mean = reference_grads(v, *all_batches(5))
        own = reference_grads(v, x, y)
        expected = [mean[0], mean[1], own[2] / (size() if scale else 1), mean[3]]
        assert_close(got, expected, what=f"partial scale={scale}")


def test_persistent_and_nested_sources():
    v = make_vars()
    x, y = batch(rank(), 6)
    with tf.GradientTape(persistent=True) as tape:
        loss = loss_fn(v, x, y)
    tape = hvd.DistributedGradientTape(tape)
    mean = reference_grads(v, *all_batches(6))
    for _ in range(2):  # a persistent tape can be asked twice
        got = tape.gradient(loss, {"a": [v["w1"], v["b1"]], "b": (v["w2"], v["b2"])})
        assert set(got) == {"a", "b"} and isinstance(got["b"], tuple)
        assert_close([*got["a"], *got["b"]], mean, what="nested sources")


@pytest.mark.parametrize("mode", MODES)
def test_gradient_of_the_reduced_gradients(mode):
    """A gradient penalty: an outer tape differentiates the squared norm of the reduced
    gradients. The allreduce's gradient is the same allreduce of the upstream gradients
    (Horovod's), so rank r gets 2 H_r g: its own loss's Hessian times the mean gradient g. In a
    graph the tape adds the kernel itself (its gradient registered on the op type)."""
    v = make_vars()
    x, y = batch(rank(), 7)

    def penalty_grads(x, y):
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                loss = loss_fn(v, x, y)
            grads = hvd.DistributedGradientTape(inner).gradient(loss, order(v))
            penalty = tf.add_n([tf.reduce_sum(g * g) for g in grads])
        return outer.gradient(penalty, order(v))

    fn = penalty_grads if mode == "eager" else tf.function(penalty_grads)
    got = fn(tf.constant(x), tf.constant(y))
    mean = reference_grads(v, *all_batches(7))
    with tf.GradientTape() as outer:
        with tf.GradientTape() as inner:
            loss = loss_fn(v, tf.constant(x), tf.constant(y))
        own = inner.gradient(loss, order(v))
        hvp = tf.add_n([tf.reduce_sum(g * tf.stop_gradient(2 * m)) for g, m in zip(own, mean)])
    assert_close(got, outer.gradient(hvp, order(v)), what=f"gradient penalty ({mode})")


def test_validation_messages():
    with tf.GradientTape() as tape:
        pass
    with pytest.raises(ValueError, match=r"^gradient_predivide_factor not supported with op "):
        hvd.DistributedGradientTape(tape, op=hvd.Sum, gradient_predivide_factor=2.0)
    msg = r"^groups should be a non-negative integer or a list of list of tf\.Variable\.$"
    for bad in (-1, 0, "2"):
        with pytest.raises(ValueError, match=msg):
            hvd.DistributedGradientTape(tape, groups=bad)
    with pytest.raises(ValueError, match="All local layers must be of tf.keras.layers.Layer"):
        hvd.PartialDistributedGradientTape(tape, local_layers=[object()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvd.DistributedGradientTape(tape, op=hvd.Average, gradient_predivide_factor=2.0)
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)
