"""bagua_hvd.tensorflow.keras / bagua_hvd.keras: the distributed Keras optimizer with Keras 3.

Runs inside a launched job (tests/test_keras.py starts it at 1 and 2 ranks). Data: a global
data set cut into global batches of size() * B rows; rank r trains on rows [r*B, (r+1)*B) of
every global batch (model.fit with shuffle=False). The reference is plain Keras (no bagua_hvd) in
the same process, trained on the whole data set with batch size size() * B: with equal per-rank
batches the mean loss of a global batch has the mean of the per-rank gradients as its gradient.
Everything runs in float64 so that 1e-5 relative agreement is meaningful.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tape_requests import spy_grouped_requests  # noqa: E402

import bagua_hvd.keras as hvd_keras  # noqa: E402
import bagua_hvd.tensorflow as hvd_tf  # noqa: E402
import bagua_hvd.tensorflow.keras as hvd  # noqa: E402

D_IN, D_HID, D_OUT, B, STEPS, VOCAB, SEQ = 5, 7, 3, 4, 4, 13, 3
RTOL, ATOL = 1e-5, 1e-9


@pytest.fixture(scope="module", autouse=True)
def keras_init():
    hvd.init()
    set_float("float64")
    yield
    set_float("float32")


def set_float(dtype):
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def size():
    return hvd.size()


def rank():
    return hvd.rank()


# ---- models and data ---------------------------------------------------------------------------
def init_weights(model, seed=7):
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(0, 0.5, w.shape) for w in model.get_weights()])
    return model


def mlp(seed=7, cls=keras.Sequential):
    model = cls(
        [
            keras.Input((D_IN,)),
            keras.layers.Dense(D_HID, activation="tanh"),
            keras.layers.Dense(D_OUT),
        ]
    )
    return init_weights(model, seed)


def embedding_model(seed=5):
    model = keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(D_OUT),
        ]
    )
    return init_weights(model, seed)


def global_data(steps=STEPS, seed=11, sparse=False):
    rng = np.random.default_rng(seed)
    n = steps * size() * B
    if sparse:
        x = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    else:
        x = rng.normal(0, 1, (n, D_IN))
    return x, rng.normal(0, 1, (n, D_OUT))


def my_slice(a):
    """This rank's rows of every global batch of size() * B rows."""
    per = a.reshape(-1, size(), B, *a.shape[1:])
    return per[:, rank()].reshape(-1, *a.shape[1:])


def reference_fit(make_model, opt, x, y, batch_size):
    model = make_model()
    # Eager: a handful of steps costs less than tracing the train function.
    model.compile(optimizer=opt, loss="mse", run_eagerly=True)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def dist_fit(make_model, opt, x, y, batch_size=B):
    model = make_model()
    model.compile(optimizer=opt, loss="mse")
    hist = model.fit(my_slice(x), my_slice(y), batch_size=batch_size, epochs=1, shuffle=False,
                     verbose=0)  # fmt: skip
    return model, hist


def assert_weights(got, expected, rtol=RTOL, atol=ATOL, what=""):
    assert len(got) == len(expected), what
    for i, (g, e) in enumerate(zip(got, expected)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"{what}[{i}]")  # fmt: skip


def assert_same_on_all_ranks(weights, what=""):
    for i, w in enumerate(weights):
        w = np.asarray(w, dtype=np.float64)
        gathered = hvd_tf.allgather(tf.constant(w.reshape(1, -1))).numpy()
        for r in range(size()):
            np.testing.assert_array_equal(gathered[r], w.reshape(-1), err_msg=f"{what}[{i}] r{r}")


def moved(model_weights, make_model):
    init = make_model().get_weights()
    return any(not np.allclose(a, b) for a, b in zip(model_weights, init))


# ---- API surface -------------------------------------------------------------------------------
def test_exports():
    common = [
        "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline", "size",
        "local_size", "cross_size", "rank", "local_rank", "cross_rank", "mpi_threads_supported",
        "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
        "ccl_built", "cuda_built", "rocm_built", "global_process_set", "Average", "Sum",
        "Compression", "DistributedOptimizer", "broadcast_global_variables", "allreduce",
        "allgather", "broadcast", "reducescatter", "load_model",
    ]  # fmt: skip
    for mod in (hvd, hvd_keras):
        missing = [n for n in common if not hasattr(mod, n)]
        assert not missing, (mod.__name__, missing)
    for mod in (hvd, hvd_keras):
        assert hasattr(mod.callbacks, "BroadcastGlobalVariablesCallback"), mod.__name__
    for n in ("ProcessSet", "add_process_set", "remove_process_set"):
        assert hasattr(hvd, n) and not hasattr(hvd_keras, n), n
    for n in ("Adasum", "Min", "Max", "Product", "PartialDistributedOptimizer"):
        assert not hasattr(hvd, n), n
    assert hasattr(hvd_keras, "Adasum") and hasattr(hvd_keras, "PartialDistributedOptimizer")
    for n in ("Min", "Max", "Product"):
        assert not hasattr(hvd_keras, n), n
    import inspect

    sig = inspect.signature
    assert sig(hvd.allreduce).parameters["average"].default is None
    assert sig(hvd_keras.allreduce).parameters["average"].default is True
    p = sig(hvd.DistributedOptimizer).parameters
    assert p["backward_passes_per_step"].default == 1 and "process_set" in p
    p = sig(hvd_keras.DistributedOptimizer).parameters
    assert "backward_passes_per_step" not in p and "process_set" not in p


def test_wrapped_type_and_from_config():
    base = keras.optimizers.SGD(learning_rate=0.05, momentum=0.5)
    opt = hvd.DistributedOptimizer(base, backward_passes_per_step=3)
    assert type(opt).__module__ == "bagua_hvd._keras"
    assert type(opt).__name__ == "SGD"
    assert isinstance(opt, keras.optimizers.SGD)
    assert opt.get_config()["momentum"] == 0.5
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.05)
    again = opt.__class__.from_config(opt.get_config())
    assert type(again) is type(opt)
    assert again._agg_helper is not None and again._agg_helper.backward_passes_per_step == 3
    assert hvd.DistributedOptimizer(keras.optimizers.Adam())._agg_helper is None
    assert type(hvd_keras.DistributedOptimizer(keras.optimizers.Adam())).__module__ == (
        "bagua_hvd._keras"
    )


def test_errors():
    sgd = keras.optimizers.SGD
    for op in (hvd_tf.Adasum, hvd_tf.Min, hvd_tf.Max, hvd_tf.Product):
        with pytest.raises(ValueError, match="op currently only supports Average and Sum"):
            hvd.DistributedOptimizer(sgd(), op=op)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op"):
        hvd.DistributedOptimizer(sgd(), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="Adasum does not support average_aggregated"):
        hvd.DistributedOptimizer(sgd(), op=hvd_tf.Adasum, average_aggregated_gradients=True)
    with pytest.raises(ValueError, match="groups should be a non-negative integer"):
        hvd.DistributedOptimizer(sgd(), groups=-1)
    with pytest.raises(ValueError, match="All local layers must be of tf.keras.layers.Layer"):
        hvd_keras.PartialDistributedOptimizer(sgd(), local_layers=[object()])
    with pytest.raises(RuntimeError, match="does not support eager execution"):
        hvd.broadcast_global_variables(0)


def test_xla_is_refused_clearly():
    x, y = global_data(steps=1, seed=10)
    model = mlp()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD()), loss="mse",
                  jit_compile=True)  # fmt: skip
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(my_slice(x), my_slice(y), batch_size=B, verbose=0)


def test_value_collectives():
    r, n = rank(), size()
    got = hvd.allreduce(np.array([1.0, 2.0]) * (r + 1))
    np.testing.assert_allclose(got.numpy(), np.array([1.0, 2.0]) * (n + 1) / 2)
    got = hvd.allreduce(np.array([1.0]) * (r + 1), op=hvd.Sum)
    np.testing.assert_allclose(got.numpy(), [n * (n + 1) / 2])
    got = hvd_keras.allreduce(np.array([2.0]) * (r + 1))  # average=True by default
    np.testing.assert_allclose(got.numpy(), [n + 1.0])
    got = hvd_keras.allreduce(np.array([2.0]) * (r + 1), average=False)
    np.testing.assert_allclose(got.numpy(), [n * (n + 1.0)])
    got = hvd.allgather(np.full((2, 1), float(r)))
    np.testing.assert_array_equal(got.numpy().ravel(), np.repeat(np.arange(n, dtype=float), 2))
    got = hvd.broadcast(np.array([float(r + 5)]), 0)
    np.testing.assert_array_equal(got.numpy(), [5.0])
    got = hvd.reducescatter(np.arange(2.0 * n).reshape(n, 2) * (r + 1), op=hvd.Sum)
    expected = np.arange(2.0 * n).reshape(n, 2)[r : r + 1] * n * (n + 1) / 2
    np.testing.assert_allclose(got.numpy(), expected)


# ---- model.fit against one process -------------------------------------------------------------
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(learning_rate=0.01),
    ],
    ids=["sgd", "adam"],
)
def test_fit_matches_single_process(make_opt):
    x, y = global_data()
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    opt = hvd.DistributedOptimizer(make_opt())
    model, _ = dist_fit(mlp, opt, x, y)
    assert_weights(model.get_weights(), ref, what="fit")
    assert moved(ref, mlp)
    assert int(opt.iterations.numpy()) == STEPS


def test_standalone_keras_fit():
    x, y = global_data(seed=12)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.1)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    model, _ = dist_fit(mlp, hvd_keras.DistributedOptimizer(make_opt()), x, y)
    assert_weights(model.get_weights(), ref, what="bagua_hvd.keras fit")


class CustomStepModel(keras.Sequential):
    """A custom train_step (Keras 3 style): tape gradients, then optimizer.apply(...)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def test_custom_train_step():
    x, y = global_data(seed=13)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.5)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    model, _ = dist_fit(
        lambda: mlp(cls=CustomStepModel), hvd.DistributedOptimizer(make_opt()), x, y
    )
    assert_weights(model.get_weights(), ref, what="custom train_step")


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_gradient_tape_loop(mode):
    x, y = global_data(seed=14)
    make_opt = lambda: keras.optimizers.Adam(learning_rate=0.02)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    model = mlp()
    opt = hvd.DistributedOptimizer(make_opt())

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    fn = step if mode == "eager" else tf.function(step)
    xs, ys = my_slice(x), my_slice(y)
    for s in range(STEPS):
        fn(tf.constant(xs[s * B : (s + 1) * B]), tf.constant(ys[s * B : (s + 1) * B]))
    assert_weights(model.get_weights(), ref, what=f"tape loop ({mode})")


@pytest.mark.parametrize("average", [True, False])
def test_backward_passes_per_step(average):
    """Two passes per update: the update uses the sum (or mean) of two per-rank gradients,
    averaged over ranks, i.e. the mean gradient of two global batches (times 2 for the sum).
    SGD with momentum is linear in the gradient, so the sum equals plain SGD with lr * 2."""
    lr = 0.05
    x, y = global_data(steps=2 * STEPS, seed=15)
    factor = 1.0 if average else 2.0
    ref = reference_fit(
        mlp, keras.optimizers.SGD(learning_rate=lr * factor, momentum=0.9), x, y, 2 * size() * B
    )
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=lr, momentum=0.9),
        backward_passes_per_step=2, average_aggregated_gradients=average,
    )  # fmt: skip
    model, _ = dist_fit(mlp, opt, x, y)
    assert_weights(model.get_weights(), ref, what=f"backward_passes_per_step=2 avg={average}")
    # Horovod: iterations advance on every pass; the counter is back to 0 after an update.
    assert int(opt.iterations.numpy()) == 2 * STEPS
    assert int(opt._agg_helper.counter.numpy()) == 0


def test_agg_helper_counter_eager():
    """Three passes per update, called by hand: the counter counts the passes since the last
    update; the variable moves only on every third call, by -lr * mean_ranks(sum of 3 grads)."""
    lr, n = 0.5, size()
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(learning_rate=lr), backward_passes_per_step=3
    )
    var = keras.Variable(np.zeros(2), name="v")
    expected = np.zeros(2)
    acc = np.zeros(2)
    counters = []
    for t in range(7):
        g = np.array([rank() + 1.0, t + 1.0])
        all_g = np.array([[r + 1.0, t + 1.0] for r in range(n)]).mean(axis=0)
        acc += all_g
        opt.apply_gradients([(tf.constant(g), var)])
        counters.append(int(opt._agg_helper.counter.numpy()))
        if (t + 1) % 3 == 0:
            expected = expected - lr * acc
            acc = np.zeros(2)
        np.testing.assert_allclose(var.numpy(), expected, rtol=1e-12, err_msg=f"pass {t}")
    assert counters == [1, 2, 0, 1, 2, 0, 1]
    assert int(opt.iterations.numpy()) == 7


def test_op_sum():
    """op=Sum: the update uses the sum over ranks = size * the mean: plain SGD with lr * size."""
    lr = 0.03
    x, y = global_data(seed=16)
    ref = reference_fit(
        mlp, keras.optimizers.SGD(learning_rate=lr * size(), momentum=0.5), x, y, size() * B
    )
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=0.5), op=hvd.Sum)
    model, _ = dist_fit(mlp, opt, x, y)
    assert_weights(model.get_weights(), ref, what="op=Sum")


def test_predivide_and_groups(monkeypatch):
    x, y = global_data(seed=17)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.1)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    seen = []
    spy_grouped_requests(monkeypatch, hvd_tf, lambda ts, _, *f: seen.append((len(ts), *f)))
    probe = mlp()
    k1, b1, k2, b2 = probe.trainable_variables
    cases = [
        ({"groups": 2}, [(2, 1.0, 1.0), (2, 1.0, 1.0)]),
        ({"groups": [[k1, b2]]}, [(2, 1.0, 1.0), (1, 1.0, 1.0), (1, 1.0, 1.0)]),
        ({"gradient_predivide_factor": 4.0}, [(4, 0.25, 4.0)]),
    ]
    for kw, expected in cases:
        model = probe if "groups" in kw and isinstance(kw["groups"], list) else mlp()
        init_weights(model)
        model.compile(optimizer=hvd.DistributedOptimizer(make_opt(), **kw), loss="mse")
        seen.clear()
        model.fit(my_slice(x), my_slice(y), batch_size=B, shuffle=False, verbose=0)
        assert_weights(model.get_weights(), ref, what=f"{kw}")
        # Traced once per tf.function (the collectives then run on every step).
        assert seen[: len(expected)] == ([] if size() == 1 else expected), (kw, seen)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_embedding(sparse_as_dense, monkeypatch):
    """Embedding gradients are tf.IndexedSlices: allgathered (or densified) then averaged."""
    x, y = global_data(seed=18, sparse=True)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.2, momentum=0.5)  # noqa: E731
    ref = reference_fit(embedding_model, make_opt(), x, y, size() * B)
    gathers = []
    real = hvd_tf.grouped_allgather  # grouped_allreduce's IndexedSlices path (as Horovod)

    def spy(ts, *a, **kw):
        gathers.extend(t.dtype for t in ts)
        return real(ts, *a, **kw)

    monkeypatch.setattr(hvd_tf.functions, "grouped_allgather", spy)
    opt = hvd.DistributedOptimizer(make_opt(), sparse_as_dense=sparse_as_dense)
    model, _ = dist_fit(embedding_model, opt, x, y)
    assert_weights(model.get_weights(), ref, what=f"embedding sparse_as_dense={sparse_as_dense}")
    if size() > 1:
        assert bool(gathers) == (not sparse_as_dense), gathers


def test_compression_fp16(monkeypatch):
    x, y = global_data(seed=19)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.1)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    wire = []
    spy_grouped_requests(monkeypatch, hvd_tf, lambda ts, *_: wire.extend(t.dtype for t in ts))
    opt = hvd.DistributedOptimizer(make_opt(), compression=hvd.Compression.fp16)
    model, _ = dist_fit(mlp, opt, x, y)
    # fp16 keeps ~3 decimal digits of each averaged gradient.
    assert_weights(model.get_weights(), ref, rtol=2e-3, atol=2e-3, what="fp16")
    if size() > 1:
        assert wire and all(d == tf.float16 for d in wire), wire
    assert all(w.dtype == np.float64 for w in model.get_weights())


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_partial_distributed_optimizer(mode):
    """Local layer: its own gradient / size (scale_local_gradients), not reduced; the other
    layers: the mean gradient. Plain SGD, one step, reference from tf.GradientTape."""
    lr, n = 0.1, size()
    x, y = global_data(steps=1, seed=20)
    xs, ys = my_slice(x), my_slice(y)
    ref_model = mlp()

    def grads_of(m, xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(xb) - yb))
        return [g.numpy() for g in tape.gradient(loss, m.trainable_variables)]

    local_g = grads_of(ref_model, xs, ys)
    mean_g = grads_of(ref_model, x, y)
    init = [v.numpy() for v in ref_model.trainable_variables]
    expected = [
        w - lr * (lg / n if i < 2 else mg)
        for i, (w, lg, mg) in enumerate(zip(init, local_g, mean_g))
    ]
    model = mlp()
    opt = hvd_keras.PartialDistributedOptimizer(
        keras.optimizers.SGD(learning_rate=lr), local_layers=model.layers[0]
    )

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    (step if mode == "eager" else tf.function(step))(tf.constant(xs), tf.constant(ys))
    assert_weights([v.numpy() for v in model.trainable_variables], expected, what="partial")


# ---- saving and loading ------------------------------------------------------------------------
def shared_tmpdir():
    path = tempfile.mkdtemp(prefix="bagua_hvd_keras_") if rank() == 0 else None
    return hvd_tf.broadcast_object(path, 0, name="keras_tmpdir")


def from_root(a):
    return hvd_tf.broadcast(tf.constant(a), 0).numpy()


@pytest.mark.parametrize("distributed_when_saved", [True, False])
def test_load_model(distributed_when_saved):
    x, y = global_data(seed=21)
    base = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base) if distributed_when_saved else base
    model, _ = dist_fit(mlp, opt, x, y)
    d = shared_tmpdir()
    path = os.path.join(d, "model.keras")
    try:
        if rank() == 0:
            model.save(path)
        hvd.allreduce(np.zeros(1), name="keras_saved")  # barrier: the file is there
        loaded = hvd.load_model(path)
        lopt = loaded.optimizer
        assert type(lopt).__module__ == "bagua_hvd._keras" and type(lopt).__name__ == "SGD"
        assert lopt.get_config()["momentum"] == pytest.approx(0.9)
        assert int(lopt.iterations.numpy()) == STEPS
        # What rank 0 saved (with a plain optimizer the ranks' models differ).
        saved = [from_root(w) for w in model.get_weights()]
        assert_weights(loaded.get_weights(), saved, rtol=0, atol=0, what="loaded")
        # Optimizer state (momentum buffers) restored too.
        momenta = [from_root(v.numpy()) for v in opt.variables if "momentum" in v.path]
        lmomenta = [v.numpy() for v in lopt.variables if "momentum" in v.path]
        assert len(momenta) == 4 and len(lmomenta) == 4
        assert_weights(lmomenta, momenta, rtol=0, atol=0, what="momentum buffers")
        # Training the loaded model keeps the ranks in step (it reduces gradients).
        loaded.fit(my_slice(x)[: 2 * B], my_slice(y)[: 2 * B] + rank(), batch_size=B,
                   shuffle=False, verbose=0)  # fmt: skip
        assert_same_on_all_ranks(loaded.get_weights(), "loaded model after fit")
        hvd.allreduce(np.zeros(1), name="keras_loaded")  # everyone read it before cleanup
    finally:
        if rank() == 0:
            shutil.rmtree(d, ignore_errors=True)


# ---- BAGUA algorithms (bagua_hvd.tensorflow.algorithms) ----------------------------------------
def test_algorithm_gradient_allreduce_matches_reference():
    x, y = global_data(seed=22)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)  # noqa: E731
    ref = reference_fit(mlp, make_opt(), x, y, size() * B)
    from bagua_hvd.tensorflow.algorithms import GradientAllReduce

    opt = hvd.DistributedOptimizer(make_opt(), algorithm=GradientAllReduce())
    model, _ = dist_fit(mlp, opt, x, y)
    assert_weights(model.get_weights(), ref, what="GradientAllReduce")


def test_algorithm_bytegrad_fit():
    """ByteGrad (8-bit compressed allreduce): ranks stay identical, close to the exact
    allreduce, and the loss goes down."""
    from bagua_hvd.tensorflow.algorithms import ByteGrad

    x, y = global_data(steps=8, seed=23)
    x, y = x.astype(np.float32), y.astype(np.float32)
    make_opt = lambda: keras.optimizers.SGD(learning_rate=0.05)  # noqa: E731
    set_float("float32")  # the 8-bit compressor takes float32/16 gradients
    try:
        ref = reference_fit(mlp, make_opt(), x, y, size() * B)
        opt = hvd_keras.DistributedOptimizer(make_opt(), algorithm=ByteGrad())
        model, _ = dist_fit(mlp, opt, x, y)
        w = model.get_weights()
        assert w[0].dtype == np.float32
        assert_same_on_all_ranks(w, "ByteGrad weights")
        # 8-bit quantization of each chunk (255 levels over its range): close, not exact.
        assert_weights(w, ref, rtol=0.05, atol=0.02, what="ByteGrad vs exact allreduce")
        m0 = mlp()
        m0.compile(loss="mse")
        model.compile(loss="mse")
        assert model.evaluate(x, y, verbose=0) < m0.evaluate(x, y, verbose=0)
    finally:
        set_float("float64")


def test_algorithm_decentralized_fit():
    """Decentralized (weights averaged with peers after each step): the loss over the whole
    data set goes down on every rank."""
    x, y = global_data(steps=8, seed=24)
    from bagua_hvd.tensorflow.algorithms import Decentralized

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.05),
                                   algorithm=Decentralized())  # fmt: skip
    model, _ = dist_fit(mlp, opt, x, y)
    m0 = mlp()
    m0.compile(loss="mse")
    model.compile(loss="mse")
    assert model.evaluate(x, y, verbose=0) < m0.evaluate(x, y, verbose=0)


def test_algorithm_qadam_with_a_variable_without_gradient():
    """QAdam through the Keras wrapper when a variable gets no gradient: the optimizer is built
    on all the variables before the algorithm reduces (Keras would reject the first apply
    otherwise); during warm-up it is Adam on the averaged gradient (numpy reference)."""
    from bagua_hvd.tensorflow.algorithms import QAdamAlgorithm, QAdamOptimizer

    lr, (b1, b2), eps = 0.1, (0.9, 0.999), 1e-8
    w = tf.Variable(np.array([1.0, -2.0, 0.5], np.float32))
    u = tf.Variable(np.ones(2, np.float32))  # no gradient
    q = QAdamOptimizer(learning_rate=lr, warmup_steps=5, betas=(b1, b2), eps=eps)
    opt = hvd.DistributedOptimizer(q, algorithm=QAdamAlgorithm(q))
    c = np.mean(np.arange(1, size() + 1))  # rank r's loss is (r + 1) * sum(w * w)
    ref_w, m, v = np.array([1.0, -2.0, 0.5]), 0.0, 0.0
    for t in (1, 2):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * (rank() + 1)
        opt.apply_gradients(zip(tape.gradient(loss, [w, u]), [w, u]))
        g = 2 * ref_w * c
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
        ref_w = ref_w - lr / (1 - b1**t) * m / denom
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(u.numpy(), np.ones(2, np.float32))
