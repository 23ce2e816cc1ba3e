"""Per-rank tests (run by tests/test_tf_horovod_names.py through the launcher at 2 ranks) of
Horovod names that TensorFlow users import, used as Horovod's docs and tests use them:
``TensorFlowKerasState`` from the Keras elastic modules, the TF1
``hvd.BroadcastGlobalVariablesHook`` in a ``MonitoredTrainingSession``, and
``hvd.LocalGradientAggregationHelperEager``. Expected values are worked out by hand."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.tensorflow import elastic as tf_elastic  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


# ---- TensorFlowKerasState ------------------------------------------------------------------
@pytest.mark.parametrize(
    "module", ["bagua_hvd.tensorflow.keras.elastic", "bagua_hvd.keras.elastic"]
)
def test_tensorflow_keras_state_from_keras_elastic(module: str) -> None:
    """``from horovod.tensorflow.keras.elastic import TensorFlowKerasState`` (and from
    ``horovod.keras.elastic``), as Horovod's elastic docs build it:
    ``TensorFlowKerasState(model, optimizer, batch=..., epoch=...)``; sync() gives every rank
    rank 0's weights and counters, restore() goes back to the last commit, commit() moves it."""
    import importlib

    cls = importlib.import_module(module).TensorFlowKerasState
    assert cls is tf_elastic.TensorFlowKerasState
    v = float(rank() + 1)  # rank 0: 1.0
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.set_weights([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    state = cls(model, optimizer, batch=20 + rank(), epoch=10 + rank())
    state.sync()
    for w in model.get_weights():
        np.testing.assert_array_equal(w, np.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)

    model.set_weights([np.full((2, 2), 5.0, np.float32), np.full(2, 6.0, np.float32)])
    state.batch, state.epoch = 21, 11
    state.restore()
    for w in model.get_weights():
        np.testing.assert_array_equal(w, np.ones_like(w))
    assert (state.batch, state.epoch) == (20, 10)

    model.set_weights([np.full((2, 2), 5.0, np.float32), np.full(2, 6.0, np.float32)])
    state.batch, state.epoch = 22, 12
    state.commit()
    model.set_weights([np.zeros((2, 2), np.float32), np.zeros(2, np.float32)])
    state.restore()
    kernel, bias = model.get_weights()
    np.testing.assert_array_equal(kernel, np.full((2, 2), 5.0))
    np.testing.assert_array_equal(bias, np.full(2, 6.0))
    assert (state.batch, state.epoch) == (22, 12)


# ---- BroadcastGlobalVariablesHook ----------------------------------------------------------
def test_broadcast_global_variables_hook_in_monitored_training_session() -> None:
    """Horovod's TF1 recipe: each rank initializes its variables its own way, the hook gives
    every rank rank 0's values when the MonitoredTrainingSession is created, then a
    DistributedOptimizer trains in step. Rank r's loss is (r+1) * sum(w), so the averaged
    gradient is (size+1)/2 per element; after 3 steps of SGD(0.5), w = 1 - 1.5 * (size+1)/2."""
    steps, lr = 3, 0.5
    with tf.Graph().as_default():
        init = float(rank() + 1)  # rank 0: 1.0
        w = tf.compat.v1.get_variable("w", initializer=np.full(3, init, np.float64))
        noise = tf.compat.v1.get_variable(
            "noise", shape=(4,), dtype=tf.float64,
            initializer=tf.compat.v1.random_normal_initializer(seed=rank() + 1),
        )  # fmt: skip
        global_step = tf.compat.v1.train.get_or_create_global_step()
        loss = (rank() + 1.0) * tf.reduce_sum(w)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(lr))
        train_op = opt.minimize(loss, global_step=global_step)
        hook = hvd.BroadcastGlobalVariablesHook(0)
        assert isinstance(hook, tf.compat.v1.train.SessionRunHook)
        # StopAtStepHook one step later: a session that should stop refuses to run w.
        hooks = [hook, tf.compat.v1.train.StopAtStepHook(last_step=steps + 1)]
        with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess:
            w0, noise0, step0 = sess.run([w, noise, global_step])
            np.testing.assert_array_equal(w0, np.ones(3))
            assert step0 == 0
            for _ in range(steps):
                assert not sess.should_stop()
                sess.run(train_op)
            w_end = sess.run(w)
    # Every global variable, not only w (compared outside the graph: eager collectives).
    assert noise0.tolist() == hvd.broadcast_object(noise0.tolist(), 0, name="hook.noise")
    np.testing.assert_allclose(w_end, np.full(3, 1.0 - lr * steps * (size() + 1) / 2.0))


def test_broadcast_global_variables_hook_needs_a_graph() -> None:
    with pytest.raises(RuntimeError, match="TF1 graph"):
        hvd.BroadcastGlobalVariablesHook(0).begin()


# ---- LocalGradientAggregationHelperEager ---------------------------------------------------
def _allreduce_grads(grads, vars):
    """Horovod's allreduce_grads(grads, vars) contract: average each gradient across ranks."""
    return [None if g is None else hvd.allreduce(g, op=hvd.Average) for g in grads]


class _Optimizer:
    """What the helper needs of an optimizer: ``iterations``."""

    def __init__(self) -> None:
        self.iterations = tf.Variable(0, dtype=tf.int64)


@pytest.mark.parametrize("in_function", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "avg"])
def test_local_gradient_aggregation_helper_eager(in_function: bool, average: bool) -> None:
    """As Horovod's Keras optimizer drives it: compute_gradients every pass, apply_gradients
    after it. Rank r's gradients: shared (r+1) * [1, 1], None, local (r+1) * [1]. Passes 1
    and 2 of 3 return the local sums; pass 3 returns the shared sum averaged over ranks
    (3 * (size+1)/2) and the local sum divided by size (3 * (r+1) / size), each divided by 3
    with average_aggregated_gradients; only then is the closure applied."""
    n = 3
    shared = tf.Variable([0.0, 0.0], dtype=tf.float64)
    unused = tf.Variable([0.0], dtype=tf.float64)
    local = tf.Variable([0.0], dtype=tf.float64)
    c = float(rank() + 1)
    helper = hvd.LocalGradientAggregationHelperEager(
        backward_passes_per_step=n, allreduce_func=_allreduce_grads, sparse_as_dense=False,
        average_aggregated_gradients=average,
    )  # fmt: skip
    helper.register_local_var(local)
    opt = _Optimizer()
    applied = tf.Variable(0, dtype=tf.int64)
    variables = [shared, unused, local]

    def one_pass():
        grads = [tf.constant([c, c], tf.float64), None, tf.constant([c], tf.float64)]
        out = helper.compute_gradients(tuple(grads), tuple(variables))

        def apply():
            applied.assign_add(1)
            opt.iterations.assign_add(1)

        helper.apply_gradients(apply, opt, list(zip(out, variables)))
        return out

    run = tf.function(one_pass) if in_function else one_pass
    div = float(n) if average else 1.0
    for k in range(1, 2 * n + 1):
        out = run()
        assert out[1] is None
        got_shared, got_local = out[0].numpy(), out[2].numpy()
        passes = (k - 1) % n + 1
        if k % n:
            np.testing.assert_allclose(got_shared, [passes * c] * 2)
            np.testing.assert_allclose(got_local, [passes * c])
        else:
            np.testing.assert_allclose(got_shared, [n * (size() + 1) / 2.0 / div] * 2)
            np.testing.assert_allclose(got_local, [n * c / size() / div])
        assert int(helper.counter.numpy()) == k % n
        assert int(opt.iterations.numpy()) == k
        assert int(applied.numpy()) == k // n


def test_local_gradient_aggregation_helper_eager_refuses_sparse() -> None:
    helper = hvd.LocalGradientAggregationHelperEager(2, _allreduce_grads, False, False)
    var = tf.Variable([[1.0], [2.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(var, [1]))
    grad = tape.gradient(loss, var)
    assert isinstance(grad, tf.IndexedSlices)
    with pytest.raises(ValueError, match="IndexedSlices are not supported"):
        helper.compute_gradients((grad,), (var,))
    with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
        hvd.LocalGradientAggregationHelperEager(0, _allreduce_grads, False, False)
