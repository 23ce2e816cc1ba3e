"""Per-rank tests (run by tests/test_keras_callbacks.py through the launcher) of the Keras
callbacks (bagua_hvd._keras.callbacks), SyncBatchNormalization and the TF1
DistributedOptimizer of bagua_hvd.tensorflow.

Every expected value is computed here from the math (Horovod's formulas, numpy batch norm and
SGD) on data that each rank can regenerate for every rank; the code under test only produces
the values that are checked."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.tensorflow.keras import callbacks as cb  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


def gather_rows(a: np.ndarray) -> np.ndarray:
    """Every rank's copy of ``a`` stacked: [size, *a.shape]."""
    a = np.asarray(a, dtype=np.float64)
    return hvd.allgather(tf.constant(a.reshape(1, -1))).numpy().reshape((size(),) + a.shape)


def small_model(seed: int, n_in: int = 5) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((n_in,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )


def rank_data(r: int, n: int = 16, n_in: int = 5) -> tuple:
    rng = np.random.RandomState(100 + r)
    return rng.randn(n, n_in).astype("float32"), rng.randn(n, 1).astype("float32")


class Recorder(keras.callbacks.Callback):
    """Records weights, optimizer variables and the learning rate at batch boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_end_weights: list = []
        self.batch_end_opt: list = []
        self.lr_at_begin: list = []

    def on_train_batch_begin(self, batch, logs=None):
        self.lr_at_begin.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_train_batch_end(self, batch, logs=None):
        self.batch_end_weights.append([np.array(w) for w in self.model.get_weights()])
        opt_vars = [v for v in self.model.optimizer.variables if "momentum" in v.path]
        self.batch_end_opt.append([v.numpy() for v in opt_vars])


# ---- BroadcastGlobalVariablesCallback ------------------------------------------------------
def test_broadcast_makes_ranks_equal_after_first_batch() -> None:
    model = small_model(seed=10 + rank())  # a different initialization on every rank
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    local = model.layers[-1].kernel
    rec = Recorder()
    x, y = rank_data(rank())
    bcast = cb.BroadcastGlobalVariablesCallback(0, local_variables=[local])
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[bcast, rec])
    assert bcast.broadcast_done
    names = [w.path for w in model.weights]
    local_idx = names.index(local.path)
    first = rec.batch_end_weights[0]
    for i, w in enumerate(first):
        rows = gather_rows(w)
        if i == local_idx:
            if size() > 1:  # registered local: not broadcast, still rank-specific
                assert not np.allclose(rows[0], rows[1]), "local variable was broadcast"
        else:
            for r in range(size()):
                np.testing.assert_array_equal(rows[r], rows[0], err_msg=names[i])
    # The momentum buffers (created at the first apply) were broadcast too.
    assert len(rec.batch_end_opt[0]) == len(model.trainable_weights)
    for m in rec.batch_end_opt[0]:
        rows = gather_rows(m)
        for r in range(size()):
            np.testing.assert_array_equal(rows[r], rows[0])
    # Only once: after batch 2 on different data with a local optimizer, ranks differ again.
    if size() > 1:
        rows = gather_rows(rec.batch_end_weights[1][0])
        assert not np.allclose(rows[0], rows[1])


def test_broadcast_builds_unbuilt_optimizer() -> None:
    model = small_model(seed=20 + rank())
    opt = keras.optimizers.Adam(0.01)
    model.compile(opt, "mse")
    assert not opt.built
    bcast = cb.BroadcastGlobalVariablesCallback(0)
    bcast.set_model(model)
    bcast.on_batch_end(0)
    assert opt.built
    for v in list(model.weights) + list(opt.variables):
        rows = gather_rows(v.numpy())
        for r in range(size()):
            np.testing.assert_array_equal(rows[r], rows[0], err_msg=v.path)


def test_broadcast_rejects_non_variables() -> None:
    with pytest.raises(ValueError, match="tf.Variable"):
        cb.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])


# ---- MetricAverageCallback ---------------------------------------------------------------
def test_metric_average_direct() -> None:
    def logs_of(r: int) -> dict:
        return {"loss": 1.0 + r, "accuracy": 0.5 / (r + 1), "val_loss": 3.0 * r - 1.0, "lr": 0.1}

    logs = logs_of(rank())
    cb.MetricAverageCallback().on_epoch_end(0, logs)
    for key in ("loss", "accuracy", "val_loss", "lr"):
        expected = np.mean([logs_of(r)[key] for r in range(size())])
        assert float(logs[key]) == pytest.approx(expected, rel=1e-6), key
    assert sorted(logs) == ["accuracy", "loss", "lr", "val_loss"]


class LogsCopy(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.epochs: list = []

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({k: float(v) for k, v in (logs or {}).items()})


def test_metric_average_in_fit() -> None:
    model = small_model(seed=30)
    model.compile(keras.optimizers.SGD(0.01), "mse", metrics=["mae"])
    x, y = rank_data(rank())
    xv, yv = rank_data(50 + rank(), n=8)
    before, after = LogsCopy(), LogsCopy()
    hist = model.fit(
        x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv),
        callbacks=[before, cb.MetricAverageCallback(), after],
    )  # fmt: skip
    assert set(before.epochs[0]) == {"loss", "mae", "val_loss", "val_mae"}
    for e in range(2):
        for key, local in before.epochs[e].items():
            expected = gather_rows(np.array(local)).mean()
            assert after.epochs[e][key] == pytest.approx(expected, rel=1e-5), key
            assert hist.history[key][e] == pytest.approx(expected, rel=1e-5), key


# ---- LearningRateWarmupCallback / LearningRateScheduleCallback ----------------------------
def warmup_lr(initial: float, n: int, warmup: int, epoch: int, batch: int, spe: int) -> float:
    """Horovod's warm-up formula at batch `batch` (from 0) of epoch `epoch`."""
    if epoch >= warmup:
        return warmup_lr(initial, n, warmup, warmup - 1, spe - 1, spe)
    t = epoch + (batch + 1) / spe
    return initial / n * (t * (n - 1) / warmup + 1)


def test_warmup_lr_per_batch_and_momentum_correction() -> None:
    n_in, spe, bs, epochs, warmup = 3, 4, 4, 3, 2
    keras.utils.set_random_seed(40)
    model = keras.Sequential([keras.Input((n_in,)), keras.layers.Dense(1)])
    w0 = [np.array(w, dtype=np.float64) for w in model.get_weights()]
    ctor_lr, initial, mom = 0.3, 0.1, 0.9
    model.compile(keras.optimizers.SGD(ctor_lr, momentum=mom), "mse")
    rng = np.random.RandomState(7 + rank())
    x = rng.randn(spe * bs, n_in).astype("float32")
    y = rng.randn(spe * bs, 1).astype("float32")
    rec = Recorder()
    warm = cb.LearningRateWarmupCallback(initial_lr=initial, warmup_epochs=warmup)
    hist = model.fit(x, y, batch_size=bs, epochs=epochs, shuffle=False, verbose=0,
                     callbacks=[warm, rec])  # fmt: skip
    assert warm.steps_per_epoch == spe  # autodetected from Keras' params
    expected_lr = [
        warmup_lr(initial, size(), warmup, e, b, spe) for e in range(epochs) for b in range(spe)
    ]
    np.testing.assert_allclose(rec.lr_at_begin, expected_lr, rtol=1e-6)
    np.testing.assert_allclose(hist.history["lr"], [expected_lr[(e + 1) * spe - 1]
                                                    for e in range(epochs)], rtol=1e-6)  # fmt: skip
    # numpy SGD with Horovod's momentum correction: momentum * new_lr / old_lr for each step
    # whose learning rate was just set (every batch of the warm-up epochs).
    w, b = w0[0].copy(), w0[1].copy()
    mw, mb = np.zeros_like(w), np.zeros_like(b)
    prev_lr = ctor_lr
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    for step, lr in enumerate(expected_lr):
        epoch = step // spe
        m = mom * lr / prev_lr if epoch < warmup else mom
        xb, yb = (
            x64[(step % spe) * bs : (step % spe + 1) * bs],
            y64[(step % spe) * bs : (step % spe + 1) * bs],
        )
        err = xb @ w + b - yb
        gw, gb = 2.0 / bs * xb.T @ err, 2.0 / bs * err.sum(0)
        mw, mb = m * mw - lr * gw, m * mb - lr * gb
        w, b = w + mw, b + mb
        prev_lr = lr
    got = model.get_weights()
    np.testing.assert_allclose(got[0], w, rtol=2e-4, atol=1e-5)
    np.testing.assert_allclose(got[1], b, rtol=2e-4, atol=1e-5)
    assert float(model.optimizer.momentum) == mom  # the hyperparameter itself is untouched


def test_warmup_without_momentum_correction() -> None:
    keras.utils.set_random_seed(41)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    w0 = [np.array(w, dtype=np.float64) for w in model.get_weights()]
    model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "mse")
    x = np.random.RandomState(3 + rank()).randn(6, 2).astype("float32")
    y = np.ones((6, 1), "float32")
    warm = cb.LearningRateWarmupCallback(0.05, warmup_epochs=1, momentum_correction=False,
                                         steps_per_epoch=3)  # fmt: skip
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0, callbacks=[warm])
    w, b = w0[0].copy(), w0[1].copy()
    mw, mb = np.zeros_like(w), np.zeros_like(b)
    for step in range(3):
        lr = warmup_lr(0.05, size(), 1, 0, step, 3)
        xb, yb = x[2 * step : 2 * step + 2].astype(np.float64), y[2 * step : 2 * step + 2]
        err = xb @ w + b - yb
        mw = 0.5 * mw - lr * (xb.T @ err)
        mb = 0.5 * mb - lr * err.sum(0)
        w, b = w + mw, b + mb
    np.testing.assert_allclose(model.get_weights()[0], w, rtol=2e-4, atol=1e-5)


def test_schedule_staircase_in_fit() -> None:
    model = small_model(seed=42)
    model.compile(keras.optimizers.SGD(1.0), "mse")
    rec = Recorder()
    sched = cb.LearningRateScheduleCallback(
        initial_lr=0.2, multiplier=0.5, start_epoch=1, end_epoch=3, staircase=True
    )
    x, y = rank_data(rank(), n=8)
    model.fit(x, y, batch_size=4, epochs=4, shuffle=False, verbose=0, callbacks=[sched, rec])
    # epoch 0: before start_epoch, the optimizer's own 1.0; epochs 1, 2: 0.2 * 0.5**(e - 1);
    # epoch 3 (>= end_epoch): unchanged from epoch 2.
    expected = [1.0, 1.0, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1]
    np.testing.assert_allclose(rec.lr_at_begin, expected, rtol=1e-6)


def test_schedule_smooth_callable_direct() -> None:
    model = small_model(seed=43)
    model.compile(keras.optimizers.SGD(0.7), "mse")
    sched = cb.LearningRateScheduleCallback(
        initial_lr=0.3,
        multiplier=lambda e: 1.0 / (1.0 + e),
        start_epoch=0,
        end_epoch=2,
        staircase=False,
    )
    sched.set_model(model)
    sched.set_params({"steps": 5, "epochs": 3})
    sched.on_train_begin()
    assert sched.steps_per_epoch == 5
    for epoch in range(3):
        sched.on_epoch_begin(epoch)
        for batch in range(5):
            sched.on_batch_begin(batch)
            got = float(model.optimizer.learning_rate.numpy())
            e = min(epoch + batch / 5.0, 1 + 4 / 5.0)  # frozen from end_epoch on
            assert got == pytest.approx(0.3 / (1.0 + e), rel=1e-6), (epoch, batch)
            sched.on_batch_end(batch)


def test_schedule_needs_initial_lr_and_steps() -> None:
    with pytest.raises(ValueError, match="initial_lr"):
        cb.LearningRateScheduleCallback(initial_lr=None, multiplier=0.5)
    sched = cb.LearningRateScheduleCallback(0.1, multiplier=0.5, staircase=False)
    sched.set_model(small_model(seed=1))
    sched.set_params({"epochs": 1, "steps": None})
    with pytest.raises(ValueError, match="steps_per_epoch"):
        sched.on_train_begin()


# ---- BestModelCheckpoint -----------------------------------------------------------------
def test_best_model_checkpoint_saves_only_on_improvement(tmp_path) -> None:
    model = small_model(seed=50)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    ckpt = cb.BestModelCheckpoint(monitor="val_loss")
    assert ckpt.filepath is None and ckpt.save_best_only
    ckpt.set_model(model)
    with pytest.raises(ValueError, match="filepath is not set"):
        ckpt.on_train_begin()
    with pytest.raises(ValueError, match=r"\.keras"):
        ckpt.filepath = str(tmp_path / "best.ckpt")
    ckpt.filepath = str(tmp_path / "best-{epoch}.keras")
    ckpt.on_train_begin()
    values = [1.0, 0.8, 0.9, 0.5, 0.5, 0.7, 0.4]
    best = np.inf
    for epoch, v in enumerate(values):
        ckpt.on_epoch_begin(epoch)
        ckpt.on_epoch_end(epoch, {"val_loss": v})
        improved = v < best
        best = min(best, v)
        assert (tmp_path / f"best-{epoch + 1}.keras").exists() == improved, (epoch, v)
    loaded = keras.models.load_model(tmp_path / "best-7.keras")
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_best_model_checkpoint_max_mode_weights_only(tmp_path) -> None:
    model = small_model(seed=51)
    ckpt = cb.BestModelCheckpoint(monitor="acc", mode="max", save_weights_only=True)
    with pytest.raises(ValueError, match=r"\.weights\.h5"):
        ckpt.filepath = str(tmp_path / "w.keras")
    ckpt.filepath = tmp_path / "w.weights.h5"  # a PathLike is accepted
    ckpt.set_model(model)
    ckpt.on_train_begin()
    path = tmp_path / "w.weights.h5"
    for epoch, v in enumerate([0.1, 0.3, 0.2]):
        if path.exists():
            path.unlink()
        ckpt.on_epoch_begin(epoch)
        ckpt.on_epoch_end(epoch, {"acc": v})
        assert path.exists() == (epoch in (0, 1)), epoch


# ---- SyncBatchNormalization --------------------------------------------------------------
def bn_case(r: int, shape_tail: tuple, seed: int) -> tuple:
    rng = np.random.RandomState(seed + r)
    n = 3 + r  # different batch sizes per rank: the global statistics are count-weighted
    x = (rng.randn(n, *shape_tail) * (1.0 + r) + r).astype("float32")
    dy = rng.randn(n, *shape_tail).astype("float32")
    return x, dy


@pytest.mark.parametrize("shape_tail", [(4,), (2, 3, 2)])
@pytest.mark.parametrize("in_function", [False, True])
def test_sync_batch_norm_matches_global_batch(shape_tail, in_function) -> None:
    eps, momentum = 1e-3, 0.9
    c = shape_tail[-1]
    xs, dys = zip(*[bn_case(r, shape_tail, 60) for r in range(size())])
    gamma = np.linspace(0.5, 1.5, c)
    beta = np.linspace(-0.2, 0.3, c)
    layer = hvd.SyncBatchNormalization(momentum=momentum, epsilon=eps)
    layer.build((None,) + shape_tail)
    layer.gamma.assign(gamma.astype("float32"))
    layer.beta.assign(beta.astype("float32"))
    x = tf.constant(xs[rank()])

    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(x, training=True)
            loss = tf.reduce_sum(out * dys[rank()])
        gx, gg, gb = tape.gradient(loss, [x, layer.gamma, layer.beta])
        return out, gx, gg, gb

    out, gx, gg, gb = (tf.function(step) if in_function else step)(x)

    # numpy: batch norm of the concatenated global batch, and its backward pass.
    xall = np.concatenate([a.astype(np.float64).reshape(-1, c) for a in xs])
    dyall = np.concatenate([a.astype(np.float64).reshape(-1, c) for a in dys])
    n = xall.shape[0]
    mean, var = xall.mean(0), xall.var(0)
    inv = 1.0 / np.sqrt(var + eps)
    xhat_all = (xall - mean) * inv
    mine = xs[rank()].astype(np.float64).reshape(-1, c)
    my_dy = dys[rank()].astype(np.float64).reshape(-1, c)
    xhat = (mine - mean) * inv
    expected_out = gamma * xhat + beta
    expected_gx = gamma * inv / n * (n * my_dy - dyall.sum(0) - xhat * (dyall * xhat_all).sum(0))
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.numpy().reshape(-1, c), expected_out, **tol)
    np.testing.assert_allclose(gx.numpy().reshape(-1, c), expected_gx, **tol)
    np.testing.assert_allclose(gg.numpy(), (my_dy * xhat).sum(0), **tol)  # local, as BN
    np.testing.assert_allclose(gb.numpy(), my_dy.sum(0), **tol)
    np.testing.assert_allclose(layer.moving_mean.numpy(), (1 - momentum) * mean, **tol)
    np.testing.assert_allclose(
        layer.moving_variance.numpy(), momentum * 1.0 + (1 - momentum) * var, **tol
    )
    # Inference uses the moving statistics only (no communication).
    inf = layer(x, training=False).numpy().reshape(-1, c)
    mm, mv = layer.moving_mean.numpy(), layer.moving_variance.numpy()
    np.testing.assert_allclose(inf, gamma * (mine - mm) / np.sqrt(mv + eps) + beta, **tol)


def test_sync_batch_norm_masked() -> None:
    eps, c, t = 1e-3, 3, 4

    def case(r: int) -> tuple:
        rng = np.random.RandomState(90 + r)
        x = (rng.randn(2 + r, t, c) + r).astype("float32")
        mask = rng.rand(2 + r, t) > 0.4
        mask[0, 0] = True
        return x, mask

    xs, masks = zip(*[case(r) for r in range(size())])
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=eps)
    x, mask = case(rank())
    out = layer(tf.constant(x), training=True, mask=tf.constant(mask)).numpy()
    picked = np.concatenate([a[m].astype(np.float64) for a, m in zip(xs, masks)])  # [k, c]
    mean, var = picked.mean(0), picked.var(0)
    np.testing.assert_allclose(out, (x - mean) / np.sqrt(var + eps), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-4, atol=1e-5)


def test_sync_batch_norm_fused_error_and_model_fit() -> None:
    for fused in (True, None):
        with pytest.raises(ValueError, match="SyncBatchNormalization does not support fused=True"):
            hvd.SyncBatchNormalization(fused=fused)
    assert isinstance(hvd.SyncBatchNormalization(), tf.keras.layers.BatchNormalization)
    # Two layers in one model get distinct names; the model trains under model.fit.
    keras.utils.set_random_seed(70)
    model = keras.Sequential([
        keras.Input((3,)), hvd.SyncBatchNormalization(), keras.layers.Dense(2),
        hvd.SyncBatchNormalization(), keras.layers.Dense(1),
    ])  # fmt: skip
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = rank_data(rank(), n=8, n_in=3)
    model.fit(x, y, batch_size=4 + rank() % 2, epochs=1, verbose=0)
    names = [layer.name for layer in model.layers]
    assert len(set(names)) == len(names)
    # The moving statistics come from global statistics: equal on every rank.
    rows = gather_rows(model.layers[0].moving_mean.numpy())
    for r in range(size()):
        np.testing.assert_allclose(rows[r], rows[0], rtol=1e-6)
    cfg = model.layers[0].get_config()
    assert type(model.layers[0]).from_config(cfg).epsilon == cfg["epsilon"]


# ---- hvd.DistributedOptimizer (TF1 legacy optimizers) ------------------------------------
def lin_data(r: int, n: int = 6, d: int = 3) -> tuple:
    rng = np.random.RandomState(80 + r)
    return rng.randn(n, d), rng.randn(n, 1)


def np_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return 2.0 / len(x) * x.T @ (x @ w - y)  # d/dw mean((xw - y)^2)


def test_legacy_optimizer_eager_matches_sgd_on_concatenated_batches() -> None:
    w_init = np.linspace(-1, 1, 3).reshape(3, 1)
    x, y = lin_data(rank())
    w = tf.Variable(w_init.astype("float32"))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))
    assert isinstance(opt, tf.compat.v1.train.Optimizer)
    xt, yt = tf.constant(x, tf.float32), tf.constant(y, tf.float32)
    for _ in range(3):
        opt.minimize(lambda: tf.reduce_mean(tf.square(xt @ w - yt)), var_list=[w])
    xall = np.concatenate([lin_data(r)[0] for r in range(size())])
    yall = np.concatenate([lin_data(r)[1] for r in range(size())])
    ref = w_init.copy()
    for _ in range(3):
        ref = ref - 0.1 * np_grad(ref, xall, yall)
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-4, atol=1e-5)


def test_legacy_optimizer_graph_momentum_and_local_var() -> None:
    w_init = np.array([[0.5], [-0.25], [1.0]])
    lr, mom, steps = 0.05, 0.9, 4
    x, y = lin_data(rank())
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=w_init.astype("float32"))
        v = tf.compat.v1.get_variable("v", initializer=np.float32(2.0))  # worker-local
        loss = tf.reduce_mean(tf.square(tf.constant(x, tf.float32) @ w - y)) + v * (rank() + 1.0)
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.MomentumOptimizer(lr, mom))
        opt.register_local_var(v)
        gv = opt.compute_gradients(loss, var_list=[w, v])
        train = opt.apply_gradients(gv)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(steps):
                sess.run(train)
            got_w, got_v = sess.run([w, v])
    xs = [lin_data(r)[0] for r in range(size())]
    ys = [lin_data(r)[1] for r in range(size())]
    ref, acc = w_init.copy(), np.zeros_like(w_init)
    ref_v, acc_v = 2.0, 0.0
    for _ in range(steps):  # TF1 momentum: acc = mom * acc + g; var -= lr * acc
        g = np.mean([np_grad(ref, xs[r], ys[r]) for r in range(size())], axis=0)
        acc = mom * acc + g
        ref = ref - lr * acc
        gv_local = (rank() + 1.0) / size()  # local gradient, scaled by 1/size (Horovod)
        acc_v = mom * acc_v + gv_local
        ref_v = ref_v - lr * acc_v
    np.testing.assert_allclose(got_w, ref, rtol=1e-4, atol=1e-5)
    assert got_v == pytest.approx(ref_v, rel=1e-5)


def test_legacy_optimizer_graph_backward_passes_per_step() -> None:
    w_init = np.array([[0.3], [0.1], [-0.2]])
    lr, passes, runs = 0.1, 2, 4
    batches = [lin_data(10 * k + rank(), n=4) for k in range(runs)]
    with tf.Graph().as_default():
        xp = tf.compat.v1.placeholder(tf.float32, [None, 3])
        yp = tf.compat.v1.placeholder(tf.float32, [None, 1])
        w = tf.compat.v1.get_variable("w", initializer=w_init.astype("float32"))
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_mean(tf.square(xp @ w - yp))
        opt = hvd.DistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(lr), backward_passes_per_step=passes,
            average_aggregated_gradients=True,
        )  # fmt: skip
        train = opt.minimize(loss, global_step=step)
        got = []
        with tf.compat.v1.Session() as sess:
            sess.run([tf.compat.v1.global_variables_initializer(),
                      tf.compat.v1.local_variables_initializer()])  # fmt: skip
            for xb, yb in batches:
                sess.run(train, {xp: xb, yp: yb})
                got.append(sess.run(w))
            assert sess.run(step) == runs
    ref = w_init.copy()
    acc = np.zeros_like(ref)
    for k in range(runs):
        # every rank's gradient of its k-th batch at the weights of the last update
        acc += np.mean([np_grad(ref, *lin_data(10 * k + r, n=4)) for r in range(size())], axis=0)
        if (k + 1) % passes == 0:
            ref = ref - lr * acc / passes
            acc = np.zeros_like(ref)
        np.testing.assert_allclose(got[k], ref, rtol=1e-4, atol=1e-5, err_msg=f"run {k}")


def test_distributed_optimizer_errors_and_keras_delegation() -> None:
    with pytest.raises(ValueError, match="not yet supported"):
        hvd.DistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), backward_passes_per_step=2
        )
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="op == Adasum is not supported yet with Keras"):
        hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), op=hvd.Sum,
            gradient_predivide_factor=2.0,
        )  # fmt: skip
    kopt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5))
    assert isinstance(kopt, keras.optimizers.SGD)
    assert not isinstance(kopt, tf.compat.v1.train.Optimizer)
    assert kopt.get_config()["momentum"] == 0.5


def test_standalone_keras_callbacks_module(tmp_path) -> None:
    import bagua_hvd.keras.callbacks as kcb

    assert issubclass(kcb.MetricAverageCallback, keras.callbacks.Callback)
    logs = {"loss": float(rank()), "mae": 2.0 * rank()}
    kcb.MetricAverageCallback().on_epoch_end(0, logs)
    assert float(logs["loss"]) == pytest.approx(np.mean(range(size())))
    assert float(logs["mae"]) == pytest.approx(2.0 * np.mean(range(size())))
    # horovod.keras's order: (monitor, verbose, mode, save_freq); save_weights_only is keyword.
    ckpt = kcb.BestModelCheckpoint("acc", 0, "max")
    assert ckpt.mode == "max" and ckpt.save_best_only and not ckpt.save_weights_only
    ckpt.filepath = str(tmp_path / "m.keras")
    model = small_model(seed=60 + rank())
    bcast = kcb.BroadcastGlobalVariablesCallback(0)
    bcast.set_model(model)
    bcast.on_batch_end(0)
    for w in model.get_weights():
        rows = gather_rows(w)
        for r in range(size()):
            np.testing.assert_array_equal(rows[r], rows[0])
