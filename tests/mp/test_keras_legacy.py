"""bagua_hvd.tensorflow.keras with Keras 2 (tf_keras, ``TF_USE_LEGACY_KERAS=1``).

Runs inside a launched job started by tests/test_keras_legacy.py, which installs tf_keras and
sets the environment. Same scheme as tests/mp/test_keras.py: rank r fits on its slice of every
global batch; the reference is plain tf_keras in the same process on the whole global batches.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import bagua_hvd.tensorflow.keras as hvd  # noqa: E402

keras = tf.keras
D_IN, D_HID, D_OUT, B, STEPS = 5, 7, 3, 4, 4
RTOL, ATOL = 1e-5, 1e-9


@pytest.fixture(scope="module", autouse=True)
def keras_init():
    hvd.init()
    keras.backend.set_floatx("float64")
    yield


def size():
    return hvd.size()


def rank():
    return hvd.rank()


def mlp(seed=7):
    model = keras.Sequential(
        [
            keras.Input((D_IN,)),
            keras.layers.Dense(D_HID, activation="tanh"),
            keras.layers.Dense(D_OUT),
        ]
    )
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape) for w in model.get_weights()])
    return model


def global_data(steps=STEPS, seed=11):
    rng = np.random.default_rng(seed)
    n = steps * size() * B
    return rng.normal(0, 1, (n, D_IN)), rng.normal(0, 1, (n, D_OUT))


def my_slice(a):
    per = a.reshape(-1, size(), B, *a.shape[1:])
    return per[:, rank()].reshape(-1, *a.shape[1:])


def reference_fit(opt, x, y, batch_size):
    model = mlp()
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def assert_weights(got, expected, what=""):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL, err_msg=f"{what}[{i}]")


def test_running_on_tf_keras():
    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    assert keras.__name__.startswith("tf_keras"), keras.__name__
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    assert type(opt).__module__ == "bagua_hvd._keras" and type(opt).__name__ == "SGD"
    assert isinstance(opt, keras.optimizers.SGD)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        lambda: keras.optimizers.legacy.Adam(learning_rate=0.01),
    ],
    ids=["sgd", "legacy-adam"],
)
def test_fit_matches_single_process(make_opt):
    x, y = global_data()
    ref = reference_fit(make_opt(), x, y, size() * B)
    model = mlp()
    opt = hvd.DistributedOptimizer(make_opt())
    model.compile(optimizer=opt, loss="mse")
    model.fit(my_slice(x), my_slice(y), batch_size=B, shuffle=False, verbose=0)
    assert_weights(model.get_weights(), ref, what="tf_keras fit")
    assert not np.allclose(ref[0], mlp().get_weights()[0])
    assert int(opt.iterations.numpy()) == STEPS


def test_backward_passes_per_step():
    lr = 0.05
    x, y = global_data(steps=2 * STEPS, seed=12)
    ref = reference_fit(keras.optimizers.SGD(learning_rate=lr, momentum=0.9), x, y, 2 * size() * B)
    model = mlp()
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
        backward_passes_per_step=2, average_aggregated_gradients=True,
    )  # fmt: skip
    model.compile(optimizer=opt, loss="mse")
    model.fit(my_slice(x), my_slice(y), batch_size=B, shuffle=False, verbose=0)
    assert_weights(model.get_weights(), ref, what="tf_keras backward_passes_per_step=2")
    assert int(opt._agg_helper.counter.numpy()) == 0


def test_tape_loop_and_compute_gradients():
    """A GradientTape loop calling apply_gradients, and Horovod's
    ``opt._compute_gradients(loss=, var_list=, tape=)`` returning reduced gradients."""
    x, y = global_data(seed=13)
    ref = reference_fit(keras.optimizers.legacy.SGD(learning_rate=0.1), x, y, size() * B)
    model = mlp()
    opt = hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(learning_rate=0.1))

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    xs, ys = my_slice(x), my_slice(y)
    for s in range(STEPS):
        step(tf.constant(xs[s * B : (s + 1) * B]), tf.constant(ys[s * B : (s + 1) * B]))
    assert_weights(model.get_weights(), ref, what="tf_keras tape loop")

    probe = mlp()
    xa, ya = x[: size() * B], y[: size() * B]
    with tf.GradientTape() as tape:
        mean_loss = tf.reduce_mean(tf.square(probe(xa) - ya))
    expected = [g.numpy() for g in tape.gradient(mean_loss, probe.trainable_variables)]
    tape = tf.GradientTape()
    with tape:
        loss = tf.reduce_mean(tf.square(probe(xs[:B]) - ys[:B]))
    gv = opt._compute_gradients(loss=loss, var_list=probe.trainable_variables, tape=tape)
    assert_weights([g.numpy() for g, _ in gv], expected, what="_compute_gradients")


def _sgd(kind):
    if kind == "legacy":
        return keras.optimizers.legacy.SGD(learning_rate=1.0)
    return keras.optimizers.SGD(learning_rate=1.0)


@pytest.mark.parametrize("kind", ["new", "legacy"])
@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_compute_gradients_then_apply_aggregates(kind, in_function, average):
    """Horovod's hook pair with ``backward_passes_per_step=N``: ``_compute_gradients(loss,
    var_list)`` then ``apply_gradients`` (Horovod's test_tensorflow2_keras.py). Rank r's
    gradient is r+1 for every element; ``w`` is shared, ``loc`` worker-local, ``emb`` gets
    tf.IndexedSlices (densified by ``sparse_as_dense``). With SGD(1.0), every N-th call moves
    ``w`` by the sum over N passes of the mean over ranks ((size+1)/2 per pass), ``loc`` by
    its own N*(r+1) divided by size; both divided by N with ``average_aggregated_gradients``.
    The other calls change nothing but ``iterations``."""
    n, calls = 3, 7
    w = tf.Variable([0.0, 0.0], dtype=tf.float64)
    loc = tf.Variable([0.0], dtype=tf.float64)
    emb = tf.Variable([[0.0], [0.0]], dtype=tf.float64)
    c = float(rank() + 1)
    opt = hvd.DistributedOptimizer(
        _sgd(kind), backward_passes_per_step=n, average_aggregated_gradients=average,
        sparse_as_dense=True,
    )  # fmt: skip
    opt.register_local_var(loc)
    var_list = [w, loc, emb]

    def loss():
        return c * (tf.reduce_sum(w) + tf.reduce_sum(loc) + tf.reduce_sum(tf.gather(emb, [1])))

    def one_call():
        gv = opt._compute_gradients(loss, var_list=var_list)
        opt.apply_gradients(gv)

    call = tf.function(one_call) if in_function else one_call
    per_pass_shared = (size() + 1) / 2.0
    for k in range(1, calls + 1):
        call()
        updates = k // n
        scale = 1.0 if average else float(n)
        shared = -updates * scale * per_pass_shared
        local = -updates * scale * c / size()
        np.testing.assert_allclose(w.numpy(), [shared, shared], rtol=1e-12, err_msg=f"w {k}")
        np.testing.assert_allclose(loc.numpy(), [local], rtol=1e-12, err_msg=f"loc {k}")
        np.testing.assert_allclose(emb.numpy(), [[0.0], [shared]], rtol=1e-12, err_msg=f"{k}")
        assert int(opt.iterations.numpy()) == k
        assert int(opt._agg_helper.counter.numpy()) == k % n
    # Built eagerly: Horovod's eager helper.
    from bagua_hvd.tensorflow import LocalGradientAggregationHelperEager

    assert isinstance(opt._agg_helper, LocalGradientAggregationHelperEager)


@pytest.mark.parametrize("kind", ["new", "legacy"])
def test_compute_gradients_then_apply_reduces_once(kind):
    """Without aggregation, ``_compute_gradients`` returns reduced gradients and
    ``apply_gradients`` given exactly those applies them without reducing again: a local
    variable's gradient is divided by the set size once (twice would be r+1 / size**2)."""
    w = tf.Variable([0.0], dtype=tf.float64)
    loc = tf.Variable([0.0], dtype=tf.float64)
    c = float(rank() + 1)
    opt = hvd.DistributedOptimizer(_sgd(kind))
    opt.register_local_var(loc)
    gv = opt._compute_gradients(lambda: c * (w[0] + loc[0]), var_list=[w, loc])
    np.testing.assert_allclose([g.numpy()[0] for g, _ in gv], [(size() + 1) / 2.0, c / size()])
    opt.apply_gradients(gv)
    np.testing.assert_allclose(w.numpy(), [-(size() + 1) / 2.0], rtol=1e-12)
    np.testing.assert_allclose(loc.numpy(), [-c / size()], rtol=1e-12)
    # A tape loop's own gradients are still reduced by apply_gradients (bagua_hvd's promise).
    with tf.GradientTape() as tape:
        lossv = c * (w[0] + loc[0])
    grads = tape.gradient(lossv, [w, loc])
    opt.apply_gradients(zip(grads, [w, loc]))
    np.testing.assert_allclose(w.numpy(), [-(size() + 1.0)], rtol=1e-12)
    np.testing.assert_allclose(loc.numpy(), [-2 * c / size()], rtol=1e-12)
