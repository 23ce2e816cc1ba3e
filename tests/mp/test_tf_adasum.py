"""op=hvd.Adasum in bagua_hvd.tensorflow: allreduce (eager and inside tf.function),
grouped_allreduce, DistributedGradientTape, and Horovod's refusals (Keras optimizers, sparse
gradients, a size that is not a power of 2). References: ``reference.adasum`` over every rank's
seeded inputs. Run: ``bagua-run -np 2 python -m pytest -q tests/mp/test_tf_adasum.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import reference as ref  # noqa: E402  (tests/ is on sys.path via tests/mp/conftest.py)

import bagua_hvd.tensorflow as hvd  # noqa: E402

hvd.init()
SIZE, RANK = hvd.size(), hvd.rank()
POWER_OF_2 = SIZE & (SIZE - 1) == 0
TOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
power_of_2 = pytest.mark.skipif(not POWER_OF_2, reason="Adasum runs on 2^k ranks (errors below)")


def inputs(case: str, shape: tuple, dtype: str) -> list:
    return ref.normal_inputs(("tf", case), SIZE, shape, dtype)


@power_of_2
@pytest.mark.parametrize("mode", ["eager", "graph"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_allreduce_adasum_is_the_tree(mode, dtype):
    xs = inputs(f"one.{mode}", (4, 3), dtype)

    def reduce(x):
        return hvd.allreduce(x, op=hvd.Adasum, name=f"tf.ada.{mode}.{dtype}")

    fn = tf.function(reduce) if mode == "graph" else reduce
    got = fn(tf.constant(xs[RANK])).numpy().astype(np.float64)
    np.testing.assert_allclose(got, ref.adasum(xs, dtype), rtol=0, atol=TOL[dtype] * 10)


@power_of_2
def test_grouped_tensors_have_their_own_coefficients():
    bs = inputs("grouped", (6,), "float64")
    a = tf.fill([5], float(RANK + 1))
    outs = hvd.grouped_allreduce([tf.cast(a, tf.float64), tf.constant(bs[RANK])], op=hvd.Adasum)
    np.testing.assert_allclose(outs[0].numpy(), np.full(5, (SIZE + 1) / 2.0), atol=1e-12)
    np.testing.assert_allclose(outs[1].numpy(), ref.adasum(bs), atol=1e-12)


@power_of_2
def test_gradient_tape_combines_every_ranks_gradient():
    # loss_r = sum(w * c_r): the gradient of rank r is c_r; the tape reduces it with Adasum.
    cs = inputs("tape", (3, 2), "float64")
    w = tf.Variable(tf.zeros([3, 2], tf.float64))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * cs[RANK])
    tape = hvd.DistributedGradientTape(tape, op=hvd.Adasum)
    (grad,) = tape.gradient(loss, [w])
    np.testing.assert_allclose(grad.numpy(), ref.adasum(cs), atol=1e-12)


def test_keras_optimizer_refuses_adasum():
    # Horovod: "op == Adasum is not supported yet with Keras".
    with pytest.raises(ValueError, match="Adasum is not supported yet with Keras"):
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), op=hvd.Adasum)


def test_sparse_gradients_refuse_adasum():
    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]))
    with pytest.raises(NotImplementedError, match="Adasum reduction does not currently support"):
        hvd.allreduce(sparse, op=hvd.Adasum)


@pytest.mark.skipif(POWER_OF_2, reason="the error of a size that is not 2^k")
def test_size_not_a_power_of_2_is_refused():
    with pytest.raises(NotImplementedError, match="non-power of 2 ranks"):
        hvd.allreduce(tf.ones([4]), op=hvd.Adasum)
    got = hvd.allreduce(tf.fill([2], float(RANK)), op=hvd.Sum, name="tf.ada.works")
    np.testing.assert_array_equal(got.numpy(), np.full(2, SIZE * (SIZE - 1) / 2))
