"""Per-rank tests (run by tests/test_tf_elastic.py through the launcher, at 1 and 2 ranks) of
``hvd.elastic`` for TensorFlow and Keras: TensorFlowState, KerasState (both Keras frontends),
the Keras elastic callbacks, ``commit()``'s host-update check and the ``run`` decorator (its
error mapping and real resets: shutdown and init of the job, at the same point on every rank).

Every expected value below is worked out by hand from Horovod's semantics (v0.28.1: its
``test_elastic_state`` tests, ``horovod/_keras/elastic.py``, ``horovod/common/elastic.py``);
the code under test only produces the values that are checked.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import bagua_hvd.keras as khvd  # noqa: E402
import bagua_hvd.tensorflow as hvd  # noqa: E402
import bagua_hvd.tensorflow.keras as tkhvd  # noqa: E402
from bagua_hvd.common.elastic import HostUpdateResult  # noqa: E402
from bagua_hvd.common.exceptions import (  # noqa: E402
    HorovodInternalError,
    HostsUpdatedInterrupt,
)
from bagua_hvd.tensorflow import elastic as tf_elastic  # noqa: E402

KERAS_FRONTENDS = {"keras": khvd, "tf.keras": tkhvd}
KERAS_ALL = [
    "KerasState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]

# The core's texts for a stopped job (see bagua_hvd/tensorflow/elastic.py).
LOST_PEER = "Horovod is shut down because communication failed: rank 1 (pid 1) on this host exited"
SHUT_DOWN = "Horovod has been shut down. This was caused by an exception on one of the ranks"


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


def values(variables) -> list:
    return [np.asarray(v.numpy()) for v in variables]


def assert_values(variables, expected) -> None:
    got = values(variables)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e)


# ---- the public names ---------------------------------------------------------------------
def test_public_names() -> None:
    assert hvd.elastic is tf_elastic
    assert tf_elastic.__all__ == ["TensorFlowKerasState", "TensorFlowState", "run"]
    for frontend in KERAS_FRONTENDS.values():
        assert frontend.elastic.__all__ == KERAS_ALL
        assert frontend.elastic.run is tf_elastic.run
        assert issubclass(frontend.elastic.KerasState, tf_elastic.TensorFlowKerasState)
        for name in KERAS_ALL[1:4]:
            assert issubclass(getattr(frontend.elastic, name), keras.callbacks.Callback)
    assert khvd.elastic.CommitStateCallback(None).batches_per_commit == 1  # Horovod's default


# ---- TensorFlowState ----------------------------------------------------------------------
def test_tensorflow_state() -> None:
    """Horovod's test_tensorflow.py::test_elastic_state, plus pitfall 4: building the state
    runs no collective (the variables are still this rank's), sync() broadcasts them."""
    v = 1.0 if rank() == 0 else 2.0
    weights1 = [np.array([[v, v], [v, v]]), np.array([v, v])]
    vars1 = [tf.Variable(arr) for arr in weights1]
    weights2 = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.0, 0.0])]

    state = hvd.elastic.TensorFlowState(vars1, batch=20 + rank(), epoch=10 + rank())
    assert_values(vars1, weights1)  # no broadcast at construction
    state.sync()

    weights1 = [np.ones_like(w) for w in weights1]
    # After sync, all values should match the root rank
    assert_values(vars1, weights1)
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then restore
    for var, w in zip(vars1, weights2):
        var.assign(w)
    state.batch = 21
    state.epoch = 11
    state.restore()
    assert_values(vars1, weights1)
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then commit
    for var, w in zip(vars1, weights2):
        var.assign(w)
    state.batch = 21
    state.epoch = 11
    state.commit()
    state.restore()
    assert_values(vars1, weights2)
    assert state.batch == 21
    assert state.epoch == 11

    # sync() again: rank 0's current variables, but its last committed properties (Horovod's
    # ObjectState broadcasts the saved values); then the synced variables are the saved ones.
    vars1[1].assign([5.0 + rank(), 6.0])
    state.batch = 30 + rank()
    state.sync()
    assert_values(vars1, [weights2[0], np.array([5.0, 6.0])])
    assert state.batch == 21 and state.epoch == 11
    vars1[1].assign([0.0, 0.0])
    state.restore()
    assert_values(vars1, [weights2[0], np.array([5.0, 6.0])])


def test_tensorflow_state_default_variables_and_session() -> None:
    # Horovod's defaults: tf.compat.v1.global_variables() (empty under eager execution) and no
    # session under eager execution.
    state = hvd.elastic.TensorFlowState(counter=3)
    assert state.variables == [] and state.session is None
    state.sync()
    assert state.counter == 3


def test_tensorflow_state_different_variables_fail_on_every_rank() -> None:
    if size() == 1:
        pytest.skip("needs two ranks")
    variables = [tf.Variable(np.zeros(3))] + ([tf.Variable(np.zeros(2))] if rank() == 1 else [])
    state = hvd.elastic.TensorFlowState(variables, batch=0)
    with pytest.raises(ValueError, match="do not hold the same variables") as e:
        state.sync()
    assert "rank 0: 1 variables; rank 1: 2 variables" in str(e.value)


# ---- KerasState ---------------------------------------------------------------------------
def dense_model(weights=None) -> keras.Model:
    model = keras.Sequential([keras.layers.Dense(2, activation="softmax")])
    model.build((2, 2))
    if weights is not None:
        model.set_weights(weights)
    return model


@pytest.mark.parametrize("frontend", list(KERAS_FRONTENDS))
def test_keras_state(frontend: str) -> None:
    """Horovod's test_tensorflow2_keras.py / test_keras.py::test_elastic_state, with the
    optimizer's variables checked too. As there, the state is built on an optimizer that has
    not updated yet: Keras 3 creates the slots at the first update, so the state builds it
    (every worker then broadcasts the same variables), with the variables, names and all, that
    Keras' own first update makes (a second optimizer, updated with zero gradients)."""
    elastic = KERAS_FRONTENDS[frontend].elastic
    v = 1.0 if rank() == 0 else 2.0
    model1 = dense_model(
        [np.array([[v, v], [v, v]], dtype=np.float32), np.array([v, v], dtype=np.float32)]
    )
    model2 = dense_model(
        [np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32), np.array([0.0, 0.0], np.float32)]
    )
    optimizer = keras.optimizers.Adam(0.001 * size())
    reference = keras.optimizers.Adam(0.001 * size())
    assert not optimizer.built
    # Zero gradients: Adam leaves the weights as they are.
    reference.apply([np.zeros(w.shape, np.float32) for w in model1.trainable_variables],
                    model1.trainable_variables)  # fmt: skip
    state = elastic.KerasState(model1, optimizer, batch=20 + rank(), epoch=10 + rank())
    assert state.model is model1 and state.optimizer is optimizer
    assert optimizer.built

    # Paths below the optimizer's own (unique) name: "adam/iterations", "adam/dense_kernel_momentum"...
    def variables(opt: keras.optimizers.Optimizer) -> list:
        assert all(var.path.startswith(f"{opt.name}/") for var in opt.variables)
        return [(var.path[len(opt.name) :], var.shape) for var in opt.variables]

    assert variables(optimizer) == variables(reference)
    slots = [var for var in optimizer.variables if var.path.endswith(("momentum", "velocity"))]
    assert len(slots) == 4
    for var in slots:
        var.assign(np.full(var.shape, v, np.float32))
    optimizer.iterations.assign(5 + rank())
    state.sync()

    model1_weights = model1.get_weights()
    model2_weights = model2.get_weights()

    # After sync, all values should match the root rank
    for w in state.model.get_weights():
        np.testing.assert_allclose(w, np.ones_like(w))
    for var in slots:
        np.testing.assert_allclose(var.numpy(), np.ones(var.shape))
    assert int(optimizer.iterations.numpy()) == 5
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then restore
    model1.set_weights(model2_weights)
    slots[0].assign(np.full(slots[0].shape, 7.0, np.float32))
    state.batch = 21
    state.epoch = 11
    state.restore()
    for w1, w2 in zip(model1.get_weights(), model1_weights):
        np.testing.assert_allclose(w1, w2)
    np.testing.assert_allclose(slots[0].numpy(), np.ones(slots[0].shape))
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify then commit
    model1.set_weights(model2_weights)
    slots[0].assign(np.full(slots[0].shape, 3.0, np.float32))
    state.batch = 21
    state.epoch = 11
    state.commit()
    state.restore()
    for w1, w2 in zip(model1.get_weights(), model2_weights):
        np.testing.assert_allclose(w1, w2)
    np.testing.assert_allclose(slots[0].numpy(), np.full(slots[0].shape, 3.0))
    assert state.batch == 21
    assert state.epoch == 11


def test_keras_state_needs_a_built_model() -> None:
    model = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"Model must be built first\. Run `model\.build"):
        khvd.elastic.KerasState(model, keras.optimizers.SGD(0.1))


def test_keras_state_without_optimizer() -> None:
    v = float(rank() + 1)
    model = dense_model([np.full((2, 2), v, np.float32), np.full(2, v, np.float32)])
    state = tkhvd.elastic.KerasState(model, step=rank())  # not compiled: no optimizer
    assert state.optimizer is None
    state.sync()
    for w in model.get_weights():
        np.testing.assert_allclose(w, np.ones_like(w))
    assert state.step == 0


# ---- commit() and host updates --------------------------------------------------------------
def test_commit_raises_hosts_updated_on_every_rank() -> None:
    """commit() saves, then broadcasts rank 0's view of the host updates: every rank raises
    HostsUpdatedInterrupt (skip_sync only for removals) when rank 0 heard of a newer one."""
    var = tf.Variable(np.zeros(2))
    state = hvd.elastic.TensorFlowState([var], counter=0)
    state.sync()

    def post(timestamp: int, res: HostUpdateResult, on_rank: int = 0) -> None:
        if rank() == on_rank:
            state._host_messages.put((timestamp, res))

    post(5, HostUpdateResult.added)
    state.counter = 1
    var.assign([1.0, 1.0])
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.commit()
    assert e.value.skip_sync is False
    assert state._last_updated_timestamp == 5
    state.counter = 2
    var.assign([2.0, 2.0])
    state.restore()  # the commit saved before it raised
    assert state.counter == 1
    assert_values([var], [np.ones(2)])

    state.commit()  # nothing new
    post(3, HostUpdateResult.added)  # not newer than 5: ignored
    state.commit()
    assert state._last_updated_timestamp == 5

    post(7, HostUpdateResult.removed)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.commit()
    assert e.value.skip_sync is True

    post(8, HostUpdateResult.removed)
    post(9, HostUpdateResult.added)
    with pytest.raises(HostsUpdatedInterrupt) as e:
        state.check_host_updates()
    assert e.value.skip_sync is False  # mixed
    assert state._last_updated_timestamp == 9

    if size() > 1:  # only rank 0's view counts
        post(20, HostUpdateResult.added, on_rank=1)
        state.commit()
        assert state._last_updated_timestamp == 9


# ---- the Keras callbacks --------------------------------------------------------------------
def compiled_model(optimizer=None) -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    opt = tkhvd.DistributedOptimizer(keras.optimizers.SGD(0.01)) if optimizer is None else optimizer
    model.compile(opt, "mse", jit_compile=False)
    return model


def dataset() -> tf.data.Dataset:
    rng = np.random.RandomState(0)
    x = rng.randn(8, 3).astype("float32")
    y = rng.randn(8, 1).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(2)


class Probe(keras.callbacks.Callback):
    """Records what the callbacks before it left in the state and in ``params``."""

    def __init__(self, state, events: list) -> None:
        super().__init__()
        self.state, self.events = state, events

    def on_epoch_begin(self, epoch, logs=None):
        self.events.append(("begin", epoch, self.params["steps"]))

    def on_batch_end(self, batch, logs=None):
        self.events.append(("batch", batch, self.state.batch, self.state.epoch))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("end", epoch, self.state.batch, self.state.epoch))


@pytest.mark.parametrize("frontend", list(KERAS_FRONTENDS))
def test_keras_callbacks(frontend: str) -> None:
    elastic = KERAS_FRONTENDS[frontend].elastic
    events: list = []

    class TrackingCommit(elastic.CommitStateCallback):
        def commit(self):
            events.append(("commit", self.state.batch, self.state.epoch))
            super().commit()

    model = compiled_model()
    data = dataset()
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)  # the optimizer's variables
    # A state resumed at epoch 3, batch 2; model.optimizer is the DistributedOptimizer.
    state = elastic.KerasState(model, batch=2, epoch=3)
    assert state.optimizer is model.optimizer
    state.sync()
    callbacks = [
        elastic.UpdateEpochStateCallback(state),
        elastic.UpdateBatchStateCallback(state),
        Probe(state, events),
        TrackingCommit(state, batches_per_commit=3),
    ]
    model.fit(data, steps_per_epoch=4, epochs=2, verbose=0, callbacks=callbacks)
    assert events == [
        # params["steps"] shortened by the 2 batches done (Keras 3 still runs 4)
        ("begin", 0, 2),
        ("batch", 0, 0, 3),
        ("batch", 1, 1, 3),
        ("batch", 2, 2, 3),
        ("commit", 2, 3),  # every 3 batches
        ("batch", 3, 3, 3),
        ("end", 0, 0, 4),  # epoch 3 + 0 + 1; batch back to 0
        ("commit", 0, 4),  # at each epoch's end
        ("begin", 1, 4),
        ("batch", 0, 0, 4),
        ("batch", 1, 1, 4),  # the count of batches goes on across epochs
        ("commit", 1, 4),
        ("batch", 2, 2, 4),
        ("batch", 3, 3, 4),
        ("end", 1, 0, 5),
        ("commit", 0, 5),
    ]
    state.batch, state.epoch = 99, 99
    state.restore()  # the last commit
    assert (state.batch, state.epoch) == (0, 5)

    # The next fit (as after a reset) starts every count again.
    events.clear()
    state.batch = 1
    model.fit(data, steps_per_epoch=4, epochs=1, verbose=0, callbacks=callbacks)
    assert events == [
        ("begin", 0, 3),
        ("batch", 0, 0, 5),
        ("batch", 1, 1, 5),
        ("batch", 2, 2, 5),
        ("commit", 2, 5),
        ("batch", 3, 3, 5),
        ("end", 0, 0, 6),
        ("commit", 0, 6),
    ]


def test_commit_callback_interrupts_fit_on_every_rank() -> None:
    model = compiled_model(keras.optimizers.SGD(0.01))
    data = dataset()
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)
    state = tkhvd.elastic.KerasState(model, batch=0, epoch=0)
    state.sync()

    class PostUpdate(keras.callbacks.Callback):
        def on_batch_end(self, batch, logs=None):
            if batch == 1 and rank() == 0:
                state._host_messages.put((1, HostUpdateResult.removed))

    callbacks = [
        tkhvd.elastic.UpdateEpochStateCallback(state),
        tkhvd.elastic.UpdateBatchStateCallback(state),
        PostUpdate(),
        tkhvd.elastic.CommitStateCallback(state),
    ]
    with pytest.raises(HostsUpdatedInterrupt) as e:
        model.fit(data, steps_per_epoch=4, epochs=2, verbose=0, callbacks=callbacks)
    assert e.value.skip_sync is True
    state.batch = 7
    state.restore()  # the interrupted commit saved batch 1 first
    assert (state.batch, state.epoch) == (1, 0)


# ---- run ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [
        tf.errors.AbortedError(None, None, LOST_PEER),
        tf.errors.FailedPreconditionError(None, None, SHUT_DOWN),
        tf.errors.DeadlineExceededError(
            None, None, "broadcast.x (handle 3) did not complete within "
            "BAGUA_HVD_OP_TIMEOUT_SECONDS=5 s"
        ),
        tf.errors.UnknownError(None, None, f"Graph execution error: ... AbortedError: {LOST_PEER}"),
        tf.errors.UnknownError(None, None, "HorovodInternalError: allreduce.x failed"),
    ],
)  # fmt: skip
def test_collective_failures_are_mapped(error: tf.errors.OpError) -> None:
    with pytest.raises(HorovodInternalError) as e:
        with tf_elastic._collective_errors():
            raise error
    assert e.value.__cause__ is error
    assert str(e.value) == str(error)


@pytest.mark.parametrize(
    "error",
    [
        tf.errors.UnknownError(None, None, "a user's py_function failed"),
        tf.errors.InvalidArgumentError(None, None, "Tensor type string is not supported."),
        tf.errors.FailedPreconditionError(None, None, "Mismatched allreduce tensor shapes"),
        tf.errors.FailedPreconditionError(None, None, "Horovod has not been initialized"),
        ValueError("user"),
    ],
)
def test_run_reraises_other_errors_unchanged(error: Exception) -> None:
    """Pitfall 5 (Horovod swallowed non-matching UnknownErrors): anything but a failed
    collective leaves run as it is, with no restore and no reset."""
    calls = []
    state = hvd.elastic.TensorFlowState([], counter=0)
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @hvd.elastic.run
    def train(state):
        calls.append("train")
        raise error

    with pytest.raises(type(error)) as e:
        train(state)
    assert e.value is error
    assert calls == ["train"]


def test_run_reraises_a_real_mismatch() -> None:
    if size() == 1:
        pytest.skip("needs two ranks")

    @hvd.elastic.run
    def train(state):
        return hvd.allreduce(tf.zeros([rank() + 1]), name="elastic.mismatch")

    with pytest.raises(tf.errors.FailedPreconditionError, match="Mismatched"):
        train(hvd.elastic.TensorFlowState([], counter=0))


class CountingState(tf_elastic.TensorFlowState):
    def __init__(self, *args, **kwargs) -> None:
        self.counts = {"sync": 0, "restore": 0}
        super().__init__(*args, **kwargs)

    def sync(self) -> None:
        self.counts["sync"] += 1
        super().sync()

    def restore(self) -> None:
        self.counts["restore"] += 1
        super().restore()


def test_run_recovers_from_a_failed_collective() -> None:
    """A TensorFlow error of a failed collective: restore to the last commit, a real reset
    (shutdown and init), the reset callbacks (after init), sync, and the function again."""
    var = tf.Variable(np.full(2, float(rank())))
    state = CountingState([var], counter=10 + rank())
    seen = []
    state.register_reset_callbacks(
        [lambda: seen.append(("reset", hvd.is_initialized(), hvd.size(), state.counter))]
    )

    @hvd.elastic.run
    def train(state, label):
        seen.append(("train", label, state.counter, float(var.numpy()[0])))
        if len(seen) == 1:
            state.counter = 11
            state.commit()
            state.counter = 12  # not committed: rolled back
            var.assign([5.0, 5.0])
            raise tf.errors.AbortedError(None, None, LOST_PEER)
        return "done"

    assert train(state, "x") == "done"
    assert seen == [
        ("train", "x", 10, 0.0),  # synced from rank 0 first
        ("reset", True, size(), 11),  # restored before the reset
        ("train", "x", 11, 0.0),
    ]
    assert state.counts == {"sync": 2, "restore": 1}
    # The job works after the reset.
    assert float(hvd.allreduce(tf.ones([]), op=hvd.Sum, name="elastic.after").numpy()) == size()


@pytest.mark.parametrize("res,syncs", [(HostUpdateResult.added, 2), (HostUpdateResult.removed, 1)])
def test_run_resets_on_hosts_updated(res: HostUpdateResult, syncs: int) -> None:
    """HostsUpdatedInterrupt from commit(): a real reset without restore; sync again unless
    hosts were only removed (and no worker is new)."""
    state = CountingState([tf.Variable(np.zeros(1))], epoch=0)
    resets = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    @hvd.elastic.run
    def train(state):
        state.epoch += 1
        if state.epoch == 1:
            if rank() == 0:
                state._host_messages.put((1, res))
            state.commit()
        return state.epoch

    assert train(state) == 2
    assert resets == [size()]
    assert state.counts == {"sync": syncs, "restore": 0}


@pytest.mark.parametrize("elastic", [False, True])
def test_set_sizes_in_a_traced_step_are_read_when_it_runs(monkeypatch, elastic: bool) -> None:
    """Horovod's rule under HOROVOD_ELASTIC=1: inside a graph the set size (sparse averages,
    local gradients' scaling, reducescatter's gradient) comes from size_op, read when the graph
    runs, since a reset may change it after the trace; elsewhere it is the traced int."""
    from bagua_hvd.common import ops as _ops
    from bagua_hvd.tensorflow import mpi_ops

    if elastic:
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    else:
        monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)

    @tf.function
    def traced() -> tf.Tensor:
        return tf.cast(mpi_ops.traced_set_size(hvd.global_process_set), tf.int32)

    assert int(traced()) == hvd.size()
    # The job "changed" after the trace: the core now says 7 ranks.
    monkeypatch.setattr(_ops, "process_set_size", lambda process_set_id: 7)
    assert int(traced()) == (7 if elastic else hvd.size())
