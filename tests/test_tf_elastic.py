"""Runs the per-rank ``hvd.elastic`` tests for TensorFlow and Keras (tests/mp/test_tf_elastic.py)
at size 1 (directly) and through the launcher at 2 ranks, and checks ``run`` against a peer
that really dies: run as a script (``python tests/test_tf_elastic.py``) under the launcher,
this file is that job's worker."""

from __future__ import annotations

import os
import re
import sys

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

from mp_runner import launch, needs_core, run_command, run_inner  # noqa: E402

pytestmark = needs_core


@pytest.mark.parametrize("np", [1, 2])
def test_tf_elastic(np: int) -> None:
    text = run_inner("test_tf_elastic.py", np)
    # Only the tests that need two ranks may skip, and only at size 1: the variables that
    # differ between ranks, the cross-rank mismatch.
    skipped = [int(s) for s in re.findall(r"(\d+) skipped", text)]
    assert sum(skipped) == (2 if np == 1 else 0), text


def test_run_maps_a_lost_peer() -> None:
    """Rank 1 dies (exit without shutting down, as a crash) while rank 0 runs a tf.function
    allreduce inside ``hvd.elastic.run``: rank 0's TensorFlow error becomes
    HorovodInternalError, so run restores the state. The same for an eager allreduce, a Keras
    ``model.fit`` step and ``KerasState.sync()`` on the stopped job."""
    text = run_command(launch(2) + [sys.executable, __file__, "lost-peer"], "the lost-peer job")
    for path in ("tf.function", "eager", "model.fit", "sync"):
        m = re.search(rf"^\[0\]<stdout>:{re.escape(path)}: (.*)$", text, re.M)
        assert m, f"no result for {path}:\n{text}"
        assert m.group(1).startswith("HorovodInternalError from "), m.group(1)
        assert "Horovod is shut down because communication failed: rank 1" in m.group(1)
    assert "rank 0 done" in text, text


def test_tensorflow_state_in_a_tf1_graph() -> None:
    """Horovod's test_elastic_state for TensorFlowState in a TF1 graph (eager execution off,
    its own job): the default variables and session, the broadcast op run by sync()."""
    text = run_command(launch(2) + [sys.executable, __file__, "tf1"], "the TF1-graph job")
    assert text.count("tf1 graph ok") == 2, text


# ---- the workers ----------------------------------------------------------------------------
def _tf1_worker() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    import bagua_hvd.tensorflow as hvd

    hvd.init()
    v = 1.0 if hvd.rank() == 0 else 2.0
    weights1 = [np.array([[v, v], [v, v]]), np.array([v, v])]
    vars1 = [tf.compat.v1.Variable(arr) for arr in weights1]
    weights2 = [np.array([[1.0, 2.0], [3.0, 4.0]]), np.array([0.0, 0.0])]
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        state = hvd.elastic.TensorFlowState(batch=20 + hvd.rank(), epoch=10 + hvd.rank())
        assert state.variables == vars1 and state.session is sess
        for w, e in zip(sess.run(vars1), weights1):  # no broadcast at construction
            np.testing.assert_allclose(w, e)
        state.sync()
        for w in sess.run(vars1):
            np.testing.assert_allclose(w, np.ones_like(w))
        assert (state.batch, state.epoch) == (20, 10)

        for var, w in zip(vars1, weights2):
            var.load(w, sess)
        state.batch, state.epoch = 21, 11
        state.restore()
        for w in sess.run(vars1):
            np.testing.assert_allclose(w, np.ones_like(w))
        assert (state.batch, state.epoch) == (20, 10)

        for var, w in zip(vars1, weights2):
            var.load(w, sess)
        state.batch, state.epoch = 21, 11
        state.commit()
        state.restore()
        for w, e in zip(sess.run(vars1), weights2):
            np.testing.assert_allclose(w, e)
        assert (state.batch, state.epoch) == (21, 11)
    print("tf1 graph ok", flush=True)


def _lost_peer_worker() -> None:
    import threading
    import time

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import bagua_hvd.tensorflow as hvd
    import bagua_hvd.tensorflow.keras as khvd
    from bagua_hvd.common.elastic import ObjectState

    hvd.init()

    class Restored(Exception):
        """Raised by restore(): run caught HorovodInternalError (and would reset next)."""

    class StopOnRestore(ObjectState):
        """No properties: sync() runs no collective (the job is stopped after the first
        case)."""

        def __init__(self) -> None:
            super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank)

        def restore(self) -> None:
            raise Restored()

    @hvd.elastic.run
    def train(state, step):
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            step()
        print("no error within 60 s", flush=True)

    def report(path: str, fn) -> None:
        try:
            fn()
            print(f"{path}: no error", flush=True)
        except Restored as e:
            error = e.__context__
            print(
                f"{path}: {type(error).__name__} from {type(error.__cause__).__name__}: "
                + " ".join(str(error).split())[-200:],
                flush=True,
            )
        except Exception as e:  # reported: the driver fails on it
            print(f"{path}: {type(e).__name__}: {e}"[:500], flush=True)

    x = tf.ones([1 << 12])
    graph_step = tf.function(lambda: hvd.allreduce(x, op=hvd.Sum, name="lost.graph"))
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(khvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), "mse", jit_compile=False)
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((4, 3), "float32"), np.ones((4, 1), "float32"))
    ).repeat().batch(2)  # fmt: skip
    model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)  # traced while the job works
    keras_state = khvd.elastic.KerasState(model, batch=0)
    for _ in range(5):
        graph_step()

    if hvd.rank() == 1:
        # Gone while rank 0 is inside the allreduces: no shutdown, exit status 0 (so that the
        # launcher lets rank 0 finish instead of stopping it).
        threading.Timer(0.3, lambda: os._exit(0)).start()
        graph_step()
        while True:
            graph_step()
    state = StopOnRestore()
    report("tf.function", lambda: train(state, graph_step))
    report("eager", lambda: train(state, lambda: hvd.allreduce(x, name="lost.eager")))
    report(
        "model.fit",
        lambda: train(state, lambda: model.fit(data, steps_per_epoch=1, epochs=1, verbose=0)),
    )

    def sync() -> None:
        try:
            keras_state.sync()
        except hvd.HorovodInternalError as e:
            raise Restored() from e  # as run would see it

    report("sync", sync)
    print(f"rank {hvd.rank()} done", flush=True)


if __name__ == "__main__":
    {"lost-peer": _lost_peer_worker, "tf1": _tf1_worker}[sys.argv[1]]()
