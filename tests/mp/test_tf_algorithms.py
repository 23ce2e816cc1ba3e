"""BAGUA's algorithms in the TensorFlow frontend (hvd.DistributedGradientTape(algorithm=...)),
run by every rank of a launched job (tests/test_tf_algorithms.py starts it at 2 and 3 ranks; it
also runs alone with plain pytest, where nothing communicates).

Each rank trains its own replica on its own data inside ``tf.function`` (some cases eagerly)
and compares its final weights with tests/reference_algorithms.py, which simulates every rank
in one process (torch) from the math of docs/algorithms.md without calling the core.
Tolerance: per tensor max |got - want| <= 1e-5 * max |want|.

Compressed algorithms quantize: a gradient that differs from the reference's in its last bit
can move a value across a quantization level (1/255 of the chunk's range), so the model of the
reference comparisons is chosen to give TensorFlow and torch the same gradient bits: every
variable W of a small MLP-shaped model gets the loss sum(0.5 a * W**2 + c * W) with per-rank,
per-step data a, c (gradient a * W + c, rounded the same way by both frameworks), and plain SGD
with a power-of-two learning rate (so Keras's x - lr * g equals torch's fused update). A real
Keras MLP is compared on the full-precision algorithms.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import reference_algorithms as ra  # noqa: E402
from quadratic import TorchQuadratic, torch_loss  # noqa: E402
from torch import nn  # noqa: E402
from unnamed_ops import check_unnamed_ops, train_until_every_rank_averaged  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.tensorflow import algorithms as A  # noqa: E402

STEPS = 5
RTOL = 1e-5
IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8
SHAPES = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
LR = 2.0**-5  # power of two: Keras's x - lr * g == torch's fused x + (-lr) * g

# The launcher's size, known at collection time. Beyond two ranks only the cases whose
# behaviour changes with an odd size or distinct left/right neighbours are collected (the
# three-rank run stays short; nothing is skipped).
SIZE = int(os.environ.get("HOROVOD_SIZE", "1"))


def up_to_two_ranks(fn):
    """Collects ``fn`` at sizes 1 and 2 only (see SIZE)."""
    return fn if SIZE <= 2 else None


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    # Several buckets per model: chunking, padding and per-bucket state are exercised.
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.001")
    monkeypatch.delenv("BAGUA_HVD_ALGORITHM", raising=False)


# ---- the quadratic model (same gradient bits in TF and torch) ---------------------------------
def init_values():
    """The same initial weights on every rank (what a broadcast gives)."""
    rng = np.random.default_rng(1234)
    return [rng.normal(0, 0.5, s).astype(np.float32) for s in SHAPES]


def data(rank, step):
    """Per-rank, per-step coefficients (a_i, c_i) for every variable."""
    rng = np.random.default_rng(1000 * rank + step + 1)
    a = [rng.uniform(0.5, 1.5, s).astype(np.float32) for s in SHAPES]
    c = [rng.normal(0, 1, s).astype(np.float32) for s in SHAPES]
    return a, c


def tf_loss(variables, a, c):
    return tf.add_n(
        [tf.reduce_sum(0.5 * ai * tf.square(v) + ci * v) for v, ai, ci in zip(variables, a, c)]
    )


def torch_sgd(params):
    return torch.optim.SGD(params, lr=LR)


def reference(name, steps=STEPS, opt_factory=torch_sgd, **kwargs):
    return ra.run_reference(
        name,
        hvd.size(),
        lambda r: TorchQuadratic(init_values()),
        lambda r, t: data(r, t),
        torch_loss,
        opt_factory,
        steps,
        **kwargs,
    )


def compare(variables, want, what):
    assert len(variables) == len(want)
    for i, (v, w) in enumerate(zip(variables, want)):
        got = np.asarray(v.numpy(), np.float64)
        w = w.detach().double().numpy()
        scale = np.abs(w).max()
        err = np.abs(got - w).max()
        assert err <= RTOL * max(scale, 1e-30), (
            f"{what}: variable {i} differs from the reference by {err:.3g} (scale {scale:.3g}) "
            f"on rank {hvd.rank()}"
        )


def make_step(variables, opt, eager=False, **tape_kwargs):
    def step(a, c):
        with tf.GradientTape() as tape:
            loss = tf_loss(variables, a, c)
        tape = hvd.DistributedGradientTape(tape, **tape_kwargs)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        tape.step_done()
        return loss

    return step if eager else tf.function(step)


def train(alg, steps=STEPS, opt=None, eager=False, **tape_kwargs):
    variables = [tf.Variable(x) for x in init_values()]
    opt = opt or tf.keras.optimizers.SGD(learning_rate=LR)
    step = make_step(variables, opt, eager, algorithm=alg, **tape_kwargs)
    for t in range(steps):
        a, c = data(hvd.rank(), t)
        step([tf.constant(x) for x in a], [tf.constant(x) for x in c])
    return variables


SYNC_CASES = [
    ("gradient_allreduce", lambda: A.GradientAllReduce(), {}),
    ("gradient_allreduce", lambda: A.GradientAllReduce(average=False), {"average": False}),
    ("gradient_allreduce", lambda: A.GradientAllReduce(hierarchical=True), {}),
    ("bytegrad", lambda: A.ByteGrad(), {}),
    ("bytegrad", lambda: A.ByteGrad(average=False), {"average": False}),
    ("bytegrad", lambda: A.ByteGrad(error_feedback=True), {"error_feedback": True}),
    ("decentralized", lambda: A.Decentralized(), {"peer_selection_mode": "all"}),
    (
        "decentralized",
        lambda: A.Decentralized(peer_selection_mode="shift_one"),
        {"peer_selection_mode": "shift_one"},
    ),
    (
        "decentralized",
        lambda: A.Decentralized(peer_selection_mode="shift_one", communication_interval=2),
        {"peer_selection_mode": "shift_one", "communication_interval": 2},
    ),
    (
        "decentralized",
        lambda: A.Decentralized(peer_selection_mode="ring"),
        {"peer_selection_mode": "ring"},
    ),
    ("low_precision_decentralized", lambda: A.LowPrecisionDecentralized(), {}),
    (
        "low_precision_decentralized",
        lambda: A.LowPrecisionDecentralized(communication_interval=2),
        {"communication_interval": 2},
    ),
]


def _case_id(c):
    return f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}"


if SIZE > 2:  # chunk padding, shift_one's idle rank, three distinct ring neighbours
    SYNC_CASES = [
        c
        for c in SYNC_CASES
        if c[0] in ("decentralized", "low_precision_decentralized")
        and c[2].get("peer_selection_mode") != "all"
        or _case_id(c) in ("bytegrad-", "bytegrad-error_feedback=True")
    ]


@pytest.mark.parametrize("name,make_alg,kwargs", SYNC_CASES, ids=[_case_id(c) for c in SYNC_CASES])
def test_matches_reference_in_tf_function(name, make_alg, kwargs):
    alg = make_alg()
    variables = train(alg)
    compare(variables, reference(name, **kwargs).params[hvd.rank()], f"{name} {kwargs}")
    if not isinstance(alg, A.GradientAllReduce) or alg.hierarchical:  # else Horovod's path
        impl = A.tape_impl(alg, hvd.global_process_set)
        assert impl.step == STEPS  # the step counter advanced inside tf.function


@up_to_two_ranks
@pytest.mark.parametrize(
    "name,make_alg,kwargs",
    [
        ("bytegrad", lambda: A.ByteGrad(error_feedback=True), {"error_feedback": True}),
        ("low_precision_decentralized", lambda: A.LowPrecisionDecentralized(), {}),
    ],
    ids=["bytegrad-ef", "low_precision_decentralized"],
)  # fmt: skip
def test_matches_reference_eagerly(name, make_alg, kwargs):
    variables = train(make_alg(), eager=True)
    compare(variables, reference(name, **kwargs).params[hvd.rank()], f"eager {name} {kwargs}")


@pytest.mark.parametrize(
    "error_feedback,weight_decay,eager",
    [(False, 0.0, False), (True, 0.01, True)] if SIZE <= 2 else [(True, 0.01, False)],
    ids=["plain-graph", "ef-wd-eager"] if SIZE <= 2 else ["ef-wd-graph"],
)
def test_qadam_matches_reference(error_feedback, weight_decay, eager):
    """Two warm-up steps (Adam, averaged gradients), then the compressed momentum with v
    frozen."""
    lr = 2.0**-7
    q = A.QAdamOptimizer(learning_rate=lr, warmup_steps=2, weight_decay=weight_decay)
    variables = train(
        A.QAdamAlgorithm(q, error_feedback=error_feedback), steps=6, opt=q, eager=eager
    )
    want = reference(
        "qadam",
        steps=6,
        opt_factory=None,
        lr=lr,
        warmup_steps=2,
        weight_decay=weight_decay,
        error_feedback=error_feedback,
    )
    compare(variables, want.params[hvd.rank()], "qadam")
    assert int(q.iterations.numpy()) == 6


def test_qadam_stays_finite_where_the_frozen_second_moment_is_tiny():
    """The mechanism of the digits example's NaN (issue 11; the torch twin of this test in
    tests/mp/test_torch_algorithms.py explains it): coordinates whose warm-up gradients were
    1e-6 times the others' freeze a second moment ~1e-12; after warm-up a curvature reaches
    them and their averaged momentum carries the chunk's quantization error. Divided by
    sqrt(v) that threw them to inf and NaN. QAdam must stay finite and, after warm-up, move no
    coordinate by more than lr per step."""
    warmup, steps, lr = 3, 30, 2.0**-7
    w = tf.Variable(tf.zeros(64))
    q = A.QAdamOptimizer(learning_rate=lr, warmup_steps=warmup)
    odd = tf.constant(np.arange(64) % 2 == 1)

    @tf.function
    def step(c, curvature):
        with tf.GradientTape() as tape:
            odd_w = tf.where(odd, w, tf.zeros_like(w))
            loss = tf.reduce_sum(c * w) + curvature * 0.5 * tf.reduce_sum(tf.square(odd_w))
        tape = hvd.DistributedGradientTape(tape, algorithm=A.QAdamAlgorithm(q))
        q.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        tape.step_done()

    for t in range(steps):
        c = np.random.default_rng(100 * hvd.rank() + t).normal(0, 1, 64).astype(np.float32)
        c[1::2] *= 1e-6
        before = w.numpy().copy()
        step(tf.constant(c), tf.constant(float(t >= warmup)))
        after = w.numpy()
        assert np.isfinite(after).all(), f"step {t + 1}: non-finite weights {after}"
        moved = np.abs(after - before).max()
        if t >= warmup:
            assert moved <= lr * (1 + 1e-5), f"step {t + 1}: a coordinate moved by {moved:.3g}"
    assert np.abs(w.numpy()[1::2]).max() < 20 * lr


@up_to_two_ranks
def test_qadam_without_algorithm_is_local_qadam():
    """At every size, QAdamOptimizer alone is the reference's single-rank QAdam on this rank's
    data (no communication: n = 1 in the reference)."""
    lr = 2.0**-7
    q = A.QAdamOptimizer(learning_rate=lr, warmup_steps=2, weight_decay=0.01)
    variables = [tf.Variable(x) for x in init_values()]

    @tf.function
    def step(a, c):
        with tf.GradientTape() as tape:
            loss = tf_loss(variables, a, c)
        q.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for t in range(5):
        a, c = data(hvd.rank(), t)
        step(a, c)
    want = ra.run_reference(
        "qadam", 1, lambda r: TorchQuadratic(init_values()), lambda r, t: data(hvd.rank(), t),
        torch_loss, None, 5, lr=lr, warmup_steps=2, weight_decay=0.01,
    )  # fmt: skip
    compare(variables, want.params[0], "local qadam")


# ---- a real Keras model --------------------------------------------------------------------------
def keras_mlp():
    tf.keras.utils.set_random_seed(7)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((IN,)),
            tf.keras.layers.Dense(HIDDEN, activation="tanh"),
            tf.keras.layers.Dense(OUT),
        ]
    )
    return model


def batches(rank, step):
    rng = np.random.default_rng(77 * rank + step)
    return rng.normal(0, 1, (BATCH, IN)).astype(np.float32), rng.normal(0, 1, (BATCH, OUT)).astype(
        np.float32
    )


@up_to_two_ranks
@pytest.mark.parametrize(
    "name,make_alg,kwargs",
    [
        ("decentralized", lambda: A.Decentralized(peer_selection_mode="ring"), {
            "peer_selection_mode": "ring"}),
    ],
    ids=["decentralized-ring"],
)  # fmt: skip
def test_keras_mlp_matches_reference(name, make_alg, kwargs):
    """A Keras MLP (its own matmul rounding: compared on full-precision algorithms)."""
    model = keras_mlp()
    init = [w.numpy() for w in model.trainable_variables]
    opt = tf.keras.optimizers.SGD(learning_rate=0.05)
    alg = make_alg()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, algorithm=alg)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        tape.step_done()

    for t in range(STEPS):
        step(*batches(hvd.rank(), t))

    def torch_mlp(rank):
        net = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))
        with torch.no_grad():
            for p, w in zip(net.parameters(), init):
                p.copy_(torch.from_numpy(w.T.copy() if w.ndim == 2 else w))
        return net

    want = ra.run_reference(
        name, hvd.size(), torch_mlp,
        lambda r, t: tuple(torch.from_numpy(b) for b in batches(r, t)), ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=0.05), STEPS, **kwargs,
    ).params[hvd.rank()]  # fmt: skip
    want = [w.T if w.ndim == 2 else w for w in want]
    compare(model.trainable_variables, want, f"keras {name}")


class QuadraticLayer(tf.keras.layers.Layer):
    """The quadratic model as a Keras layer for model.fit: each sample is one step's (a, c),
    flattened; the output is that sample's loss sum(0.5 a * W**2 + c * W)."""

    def build(self, input_shape):
        self.ws = [self.add_weight(shape=s, initializer="zeros", name=f"w{i}")
                   for i, s in enumerate(SHAPES)]  # fmt: skip

    def call(self, x):
        sizes = [int(np.prod(s)) for s in SHAPES]
        parts = tf.split(x[0], sizes + sizes)
        a = [tf.reshape(p, s) for p, s in zip(parts[: len(SHAPES)], SHAPES)]
        c = [tf.reshape(p, s) for p, s in zip(parts[len(SHAPES) :], SHAPES)]
        return tf.reshape(tf_loss(self.ws, a, c), (1, 1))


@pytest.mark.parametrize(
    "name,make_alg,kwargs",
    [
        ("bytegrad", lambda: A.ByteGrad(), {}),
        ("bytegrad", lambda: A.ByteGrad(error_feedback=True), {"error_feedback": True}),
        ("decentralized", lambda: A.Decentralized(peer_selection_mode="ring"),
         {"peer_selection_mode": "ring"}),
    ] if SIZE <= 2 else [("bytegrad", lambda: A.ByteGrad(), {})],
    ids=["bytegrad", "bytegrad-ef", "decentralized-ring"] if SIZE <= 2 else ["bytegrad"],
)  # fmt: skip
def test_model_fit_matches_reference(name, make_alg, kwargs):
    """An algorithm through Keras' model.fit with the Keras DistributedOptimizer (one sample,
    one step's data, per batch): the same weights as tests/reference_algorithms.py."""
    from bagua_hvd.tensorflow import keras as hvd_keras

    sample = tf.keras.Input((2 * sum(int(np.prod(s)) for s in SHAPES),))
    model = tf.keras.Model(sample, QuadraticLayer()(sample))
    model.set_weights(init_values())
    opt = hvd_keras.DistributedOptimizer(
        tf.keras.optimizers.SGD(learning_rate=LR), algorithm=make_alg()
    )
    # The sample's loss is the model's output: Keras' loss is its mean over the batch of one.
    model.compile(optimizer=opt, loss=lambda y_true, y_pred: y_pred[:, 0])
    x = np.stack(
        [np.concatenate([v.ravel() for v in a + c]) for a, c in
         (data(hvd.rank(), t) for t in range(STEPS))]
    )  # fmt: skip
    model.fit(x, np.zeros((STEPS, 1), np.float32), batch_size=1, shuffle=False, verbose=0)
    compare(model.trainable_variables, reference(name, **kwargs).params[hvd.rank()],
            f"model.fit {name} {kwargs}")  # fmt: skip


# ---- behaviour -----------------------------------------------------------------------------------
@up_to_two_ranks
def test_none_gradients_stay_none():
    """A variable outside the loss keeps a None gradient; the others are reduced."""
    variables = [tf.Variable(x) for x in init_values()]
    spare = tf.Variable(np.ones(3, np.float32))
    for alg, mode in ((A.ByteGrad(), "graph"), (A.Decentralized(), "eager")):

        def grads_of(a, c, alg=alg):
            with tf.GradientTape() as tape:
                loss = tf_loss(variables, a, c)
            tape = hvd.DistributedGradientTape(tape, algorithm=alg)
            return tape.gradient(loss, variables + [spare])

        a, c = data(hvd.rank(), 0)
        grads = (grads_of if mode == "eager" else tf.function(grads_of))(a, c)
        assert grads[-1] is None, type(alg).__name__
        assert all(g is not None for g in grads[:-1])


@up_to_two_ranks
def test_partial_tape_keeps_local_layers_out_of_the_algorithm():
    """PartialDistributedGradientTape with Decentralized("all"): the global variable is
    replaced by the average over the ranks, the local layer's variable keeps this rank's value,
    and its gradient is divided by the set size (scale_local_gradients)."""
    n, r = hvd.size(), hvd.rank()
    glob = tf.Variable(np.full(4, float(r), np.float32))
    local = tf.Module()
    local.w = tf.Variable(np.full(3, float(10 + r), np.float32))
    c = np.arange(7, dtype=np.float32) + 1
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(glob * c[:4]) + tf.reduce_sum(local.w * c[4:])
    tape = hvd.PartialDistributedGradientTape(
        tape, local_layers=[local], algorithm=A.Decentralized()
    )
    g_glob, g_local = tape.gradient(loss, [glob, local.w])
    np.testing.assert_array_equal(glob.numpy(), np.full(4, (n - 1) / 2, np.float32))
    np.testing.assert_array_equal(local.w.numpy(), np.full(3, 10 + r, np.float32))
    np.testing.assert_array_equal(g_glob.numpy(), c[:4])  # Decentralized: local gradients
    np.testing.assert_allclose(g_local.numpy(), c[4:] / n, rtol=1e-7)


@up_to_two_ranks
def test_get_local_and_global_gradients():
    """Horovod's (local_vars_grads, global_vars_grads): (source, gradient) pairs of the
    worker-local sources and of the others, in the sources' order, with gradient()'s values: a
    local source's own gradient divided by the set size, a global one's average over the ranks."""
    values = init_values()
    variables = [tf.Variable(x) for x in values]
    local_index = 1
    n = hvd.size()
    for mode in ("eager", "graph"):

        def both(a, c):
            with tf.GradientTape() as tape:
                loss = tf_loss(variables, a, c)
            tape = hvd.DistributedGradientTape(tape)
            tape.register_local_source(variables[local_index])
            parts = tape.get_local_and_global_gradients(loss, variables)
            # Which variable each pair names (tf.function returns tensors, not variables).
            where = {id(v): i for i, v in enumerate(variables)}
            return [[(where[id(v)], g) for v, g in part] for part in parts]

        fn = both if mode == "eager" else tf.function(both)
        local, glob = fn(*data(hvd.rank(), 3))
        per_rank = []
        for r in range(n):
            a, c = data(r, 3)
            per_rank.append([ai * x + ci for ai, ci, x in zip(a, c, values)])
        assert [int(i) for i, _ in local] == [local_index], mode
        assert [int(i) for i, _ in glob] == [i for i in range(len(values)) if i != local_index]
        mine = per_rank[hvd.rank()][local_index].astype(np.float64)
        np.testing.assert_allclose(local[0][1].numpy(), mine / n, rtol=1e-6, atol=1e-7)
        for i, g in glob:
            want = np.mean([p[int(i)].astype(np.float64) for p in per_rank], axis=0)
            np.testing.assert_allclose(g.numpy(), want, rtol=1e-6, atol=1e-6)


@up_to_two_ranks
def test_get_local_and_global_gradients_with_algorithm():
    """With an algorithm the global gradients are the algorithm's (ByteGrad: the compressed
    average, the same bits on every rank); without local sources the local list is empty."""
    variables = [tf.Variable(x) for x in init_values()]
    alg = A.ByteGrad()
    with tf.GradientTape() as tape:
        loss = tf_loss(variables, *data(hvd.rank(), 0))
    tape = hvd.DistributedGradientTape(tape, algorithm=alg)
    local, glob = tape.get_local_and_global_gradients(loss, variables)
    assert local == [] and [id(v) for v, _ in glob] == [id(v) for v in variables]
    gathered = hvd.allgather(tf.concat([tf.reshape(g, [-1]) for _, g in glob], 0)[tf.newaxis])
    for r in range(hvd.size()):
        np.testing.assert_array_equal(gathered[r].numpy(), gathered[0].numpy())


def test_low_precision_replicas_are_consistent_bitwise():
    """My copy of my left neighbour equals its own replica, bit for bit, and my weights equal
    my own replica."""
    alg = A.LowPrecisionDecentralized()
    variables = train(alg)
    impl = A.tape_impl(alg, hvd.global_process_set)
    n, r = hvd.size(), hvd.rank()
    if n == 1:
        assert impl.replicas is None
        return
    impl.flush()  # the last exchange runs in the background
    flat = np.concatenate([variables[i].numpy().reshape(-1) for b in impl._bound[1] for i in b])
    own = np.concatenate([rep[0] for rep in impl.replicas])
    np.testing.assert_array_equal(flat, own)
    stacked = np.stack([np.concatenate([rep[k] for rep in impl.replicas]) for k in range(3)])
    everyone = hvd.allgather(tf.constant(stacked[np.newaxis]), name="tf.lpdec.check").numpy()
    np.testing.assert_array_equal(everyone[(r - 1) % n][0], stacked[1])
    np.testing.assert_array_equal(everyone[(r + 1) % n][0], stacked[2])


@up_to_two_ranks
def test_environment_selects_algorithm(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "bytegrad")
    variables = train(None, eager=True)
    compare(variables, reference("bytegrad").params[hvd.rank()], "bytegrad from the environment")
    assert A.environment_algorithm() is A.environment_algorithm()


@up_to_two_ranks
def test_async_model_average_runs_rounds_and_stops():
    """Background rounds merge into the variables, abort() stops them on every rank, resume()
    restarts them; the weights stay finite."""
    alg = A.AsyncModelAverage(sync_interval_ms=5, warmup_steps=2)
    variables = [tf.Variable(x) for x in init_values()]
    step = make_step(variables, tf.keras.optimizers.SGD(learning_rate=LR), algorithm=alg)
    impl = A.tape_impl(alg, hvd.global_process_set)
    deadline = time.monotonic() + 30
    t = 0
    while time.monotonic() < deadline:
        step(*data(hvd.rank(), t % 7))
        t += 1
        if hvd.size() == 1 or (t > 10 and impl.rounds() >= 3):
            break
        time.sleep(0.002)
    assert impl.step == t
    if hvd.size() > 1:
        assert impl.rounds() >= 3, f"only {impl.rounds()} averaging rounds in {t} steps"
    alg.abort()
    assert impl.id is None
    assert all(np.isfinite(v.numpy()).all() for v in variables)
    alg.resume()
    for _ in range(3):
        step(*data(hvd.rank(), t % 7))
    if hvd.size() > 1:
        assert impl.id is not None  # restarted
    alg.abort()
    assert all(np.isfinite(v.numpy()).all() for v in variables)
    hvd.barrier()


@up_to_two_ranks
def test_reify_interface():
    """The interface the Keras DistributedOptimizer uses: reduce_gradients / after_apply."""
    variables = [tf.Variable(x) for x in init_values()]
    opt = tf.keras.optimizers.SGD(learning_rate=LR)
    impl = A.reify(A.LowPrecisionDecentralized(), opt, hvd.global_process_set)
    assert impl.needs_after_apply

    @tf.function
    def step(a, c):
        with tf.GradientTape() as tape:
            loss = tf_loss(variables, a, c)
        grads = impl.reduce_gradients(tape.gradient(loss, variables), variables)
        opt.apply_gradients(zip(grads, variables))
        impl.after_apply(variables)

    for t in range(STEPS):
        step(*data(hvd.rank(), t))
    compare(variables, reference("low_precision_decentralized").params[hvd.rank()], "reify")
    assert not A.reify(A.ByteGrad(), opt).needs_after_apply


# ---- errors --------------------------------------------------------------------------------------
def _tape():
    with tf.GradientTape() as tape:
        pass
    return tape


@up_to_two_ranks
def test_validation_messages(monkeypatch):
    with pytest.raises(ValueError, match="peer_selection_mode must be one of"):
        A.Decentralized(peer_selection_mode="star")
    with pytest.raises(ValueError, match="communication_interval must be a positive integer"):
        A.LowPrecisionDecentralized(communication_interval=0)
    with pytest.raises(ValueError, match="warmup_steps must be a positive integer"):
        A.QAdamOptimizer(warmup_steps=0)
    with pytest.raises(ValueError, match="QAdamAlgorithm needs the QAdamOptimizer"):
        A.QAdamAlgorithm(tf.keras.optimizers.Adam())
    from bagua_hvd.torch.algorithms import QAdamOptimizer as TorchQAdam

    torch_q = TorchQAdam([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="QAdamAlgorithm goes with QAdamOptimizer"):
        hvd.DistributedGradientTape(_tape(), algorithm=A.QAdamAlgorithm(torch_q))
    with pytest.raises(ValueError, match="QAdamAlgorithm goes with QAdamOptimizer"):
        A.reify(A.ByteGrad(), A.QAdamOptimizer())
    with pytest.raises(ValueError, match="cannot be combined with compression"):
        hvd.DistributedGradientTape(
            _tape(), algorithm=A.ByteGrad(), compression=hvd.Compression.fp16
        )
    with pytest.raises(ValueError, match="cannot be combined with compression= or groups="):
        hvd.PartialDistributedGradientTape(_tape(), algorithm=A.Decentralized(), groups=2)
    with pytest.raises(ValueError, match="algorithm must be an object"):
        hvd.DistributedGradientTape(_tape(), algorithm="bytegrad")
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(x * x)
    tape = hvd.DistributedGradientTape(tape, algorithm=A.Decentralized())
    with pytest.raises(ValueError, match="sources of the gradients must be variables"):
        tape.gradient(loss, [x])
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "bytegrid")
    with pytest.raises(ValueError, match="unknown algorithm 'bytegrid'"):
        hvd.DistributedGradientTape(_tape())
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "qadam")
    with pytest.raises(ValueError, match="QAdam needs its own optimizer"):
        hvd.DistributedGradientTape(_tape())


@up_to_two_ranks
def test_missing_step_done_and_other_variables_raise():
    """LowPrecisionDecentralized without tape.step_done() fails at the next step, naming the
    fix (at one rank it has nothing to do after the update: no error); a weight algorithm given
    another model's variables refuses."""
    alg = A.LowPrecisionDecentralized()
    variables = [tf.Variable(x) for x in init_values()]
    opt = tf.keras.optimizers.SGD(learning_rate=LR)
    for t in range(2):
        with tf.GradientTape() as tape:
            loss = tf_loss(variables, *data(hvd.rank(), t))
        tape = hvd.DistributedGradientTape(tape, algorithm=alg)
        if t == 0:
            grads = tape.gradient(loss, variables)
            opt.apply_gradients(zip(grads, variables))  # no step_done()
        elif hvd.size() == 1:
            tape.gradient(loss, variables)
        else:
            with pytest.raises(ValueError, match=r"tape\.step_done\(\)"):
                tape.gradient(loss, variables)
    dec = A.Decentralized()
    for vs in (variables, variables[:2]):
        with tf.GradientTape() as tape:
            loss = tf_loss(vs, *data(hvd.rank(), 0))
        tape = hvd.DistributedGradientTape(tape, algorithm=dec)
        if vs is variables:
            tape.gradient(loss, vs)
        else:
            with pytest.raises(ValueError, match="one algorithm object per model"):
                tape.gradient(loss, vs)


@up_to_two_ranks
def test_algorithms_are_shared_with_torch():
    import bagua_hvd.common.algorithms as C
    import bagua_hvd.torch.algorithms as T

    for name in ("GradientAllReduce", "ByteGrad", "Decentralized", "LowPrecisionDecentralized",
                 "QAdamAlgorithm", "AsyncModelAverage", "from_name", "BY_NAME"):  # fmt: skip
        assert getattr(A, name) is getattr(C, name) is getattr(T, name), name


@up_to_two_ranks
def test_algorithm_first_used_in_a_later_trace():
    """An implementation creates no tf.Variable, so an algorithm may first appear in a later
    trace of a tf.function (TensorFlow refuses variables created after the first trace)."""
    alg = A.ByteGrad()
    w = tf.Variable(tf.ones([4]))
    opt = tf.keras.optimizers.SGD(learning_rate=LR)
    opt.build([w])

    @tf.function
    def step(x, use_algorithm):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x)
        tape = hvd.DistributedGradientTape(tape, algorithm=alg if use_algorithm else None)
        (g,) = tape.gradient(loss, [w])
        opt.apply_gradients([(g, w)])
        return g

    x = tf.constant(np.arange(4, dtype=np.float32) * (hvd.rank() + 1))
    step(x, False)  # the first trace, without the algorithm
    g = step(x, True)
    step(x, True)
    assert A.tape_impl(alg, hvd.global_process_set).step == 2
    # The gradient is the mean of the ranks' x, within ByteGrad's quantization (two 8-bit
    # roundings of a chunk whose range is at most that of the data).
    want = np.arange(4, dtype=np.float32) * np.mean([r + 1 for r in range(hvd.size())])
    np.testing.assert_allclose(g.numpy(), want, atol=2 * 3 * hvd.size() / 255 + 1e-6)


# ---- the kernel path ---------------------------------------------------------------------------
_PY_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "NumpyFunction"}


def _op_types(concrete):
    """Every op type of a traced function, its branches (tf.cond, tf.switch_case) included."""
    gdef = concrete.graph.as_graph_def()
    types = {n.op for n in gdef.node}
    for f in gdef.library.function:
        types |= {n.op for n in f.node_def}
    return types


KERNEL_CASES = [
    ("bytegrad", lambda: A.ByteGrad()),
    ("bytegrad-ef", lambda: A.ByteGrad(error_feedback=True)),
    ("gradient_allreduce-hierarchical", lambda: A.GradientAllReduce(hierarchical=True)),
    (
        "decentralized-shift_one-2",
        lambda: A.Decentralized(peer_selection_mode="shift_one", communication_interval=2),
    ),
    ("low_precision_decentralized", lambda: A.LowPrecisionDecentralized()),
    (
        "low_precision_decentralized-2",
        lambda: A.LowPrecisionDecentralized(communication_interval=2),
    ),
    ("async", lambda: A.AsyncModelAverage(sync_interval_ms=5, warmup_steps=2)),
    ("qadam", None),
]


def _make(name, make_alg):
    """(algorithm, optimizer) of a KERNEL_CASES entry."""
    if make_alg is None:
        q = A.QAdamOptimizer(learning_rate=2.0**-7, warmup_steps=2, weight_decay=0.01)
        return A.QAdamAlgorithm(q, error_feedback=True), q
    return make_alg(), tf.keras.optimizers.SGD(learning_rate=LR)


@up_to_two_ranks
@pytest.mark.parametrize("name,make_alg", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_no_python_on_the_step_data_path(name, make_alg):
    """Inside tf.function every algorithm's step is kernels and TensorFlow's own ops: no
    numpy_function (PyFunc, EagerPyFunc, NumpyFunction) in the traced graph or its branches."""
    alg, opt = _make(name, make_alg)
    variables = [tf.Variable(x) for x in init_values()]
    step = make_step(variables, opt, algorithm=alg)
    a, c = data(hvd.rank(), 0)
    args = ([tf.constant(x) for x in a], [tf.constant(x) for x in c])
    types = _op_types(step.get_concrete_function(*args))
    assert not types & _PY_OPS, sorted(types & _PY_OPS)
    if hvd.size() > 1:
        assert types & {"BaguaHvdBuckets", "BaguaHvdLpStep", "BaguaHvdAsyncStep"}, sorted(types)
    for t in range(3):
        step(*[[tf.constant(x) for x in d] for d in data(hvd.rank(), t)])
    if name == "async":
        alg.abort()


def test_low_precision_in_place_step_leaves_tensors_read_before_it():
    """The kernel's local half writes the variables' buffers in place: a tensor read from a
    variable before tape.step_done() (sharing its buffer) keeps the values it had, and the
    weights are those of the same training without such reads, bit for bit."""
    if hvd.size() == 1:
        return  # no neighbours: the step writes nothing
    plain = train(A.LowPrecisionDecentralized(), eager=True)
    variables = [tf.Variable(x) for x in init_values()]
    opt = tf.keras.optimizers.SGD(learning_rate=LR)
    alg = A.LowPrecisionDecentralized()
    for t in range(STEPS):
        a, c = data(hvd.rank(), t)
        with tf.GradientTape() as tape:
            loss = tf_loss(variables, [tf.constant(x) for x in a], [tf.constant(x) for x in c])
        tape = hvd.DistributedGradientTape(tape, algorithm=alg)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        held = [v.value() for v in variables]  # shares each variable's buffer
        before = [h.numpy().copy() for h in held]
        tape.step_done()
        for i, (h, b) in enumerate(zip(held, before)):
            np.testing.assert_array_equal(h.numpy(), b, err_msg=f"step {t}, variable {i}")
    A.tape_impl(alg, hvd.global_process_set).flush()
    for i, (v, w) in enumerate(zip(variables, plain)):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=f"variable {i}")


# ---- a user's unnamed ops after training -----------------------------------------------------
def _tf_qadam():
    q = A.QAdamOptimizer(learning_rate=LR, warmup_steps=2)
    return q, A.QAdamAlgorithm(q)


STEPS_BEFORE_UNNAMED = 30  # past every warm-up; async: rounds while the ranks drift apart
EVERY_ALGORITHM = {
    "gradient_allreduce": lambda: (None, A.GradientAllReduce()),
    "bytegrad": lambda: (None, A.ByteGrad(error_feedback=True)),
    "qadam": _tf_qadam,
    "decentralized": lambda: (None, A.Decentralized(peer_selection_mode="shift_one")),
    "low_precision_decentralized": lambda: (None, A.LowPrecisionDecentralized()),
    "async": lambda: (None, A.AsyncModelAverage(sync_interval_ms=2, warmup_steps=2)),
}


# Inside tf.function, as training runs; eagerly too where the step takes another path (the
# async step's kernel).
UNNAMED_CASES = [(name, False) for name in sorted(EVERY_ALGORITHM)] + [("async", True)]


@pytest.mark.parametrize(
    "name,eager",
    UNNAMED_CASES,
    ids=[f"{n}-{'eager' if e else 'tf_function'}" for n, e in UNNAMED_CASES],
)
def test_unnamed_ops_after_training_with_rank_dependent_step_times(name, eager):
    """A user's unnamed collectives after training match across ranks whatever the algorithm
    did in between (rank r sleeps r ms per step, so AsyncModelAverage's background rounds run
    a different number of times on each rank)."""
    n, r = hvd.size(), hvd.rank()
    opt, alg = EVERY_ALGORITHM[name]()
    variables = [tf.Variable(x) for x in init_values()]
    step = make_step(
        variables, opt or tf.keras.optimizers.SGD(learning_rate=LR), eager, algorithm=alg
    )
    impl = A.tape_impl(alg, hvd.global_process_set)
    for t in range(STEPS_BEFORE_UNNAMED):
        step(*data(r, t % 7))
        time.sleep(0.002 * r)
    if name == "async" and n > 1:
        train_until_every_rank_averaged(
            hvd,
            impl.rounds,
            lambda: step(*data(r, 0)),
            tf.constant,
            lambda t: t.numpy().tolist(),
        )
    check_unnamed_ops(hvd, tf.constant, lambda t: t.numpy().tolist())
    if name == "async":
        alg.abort()
    hvd.barrier()
