"""algorithm="auto" in the TensorFlow frontend (DistributedGradientTape and the Keras
DistributedOptimizer), run by every rank of a launched job (tests/test_auto_algorithm.py starts
it at 2 and 3 ranks).

A candidate is made slow through the engine's test hook (BAGUA_HVD_TEST_ALGORITHM_DELAY); the
other one must be chosen, by every rank at the same step; the training after the choice must
equal the chosen algorithm run alone from the same weights; a tf.train.Checkpoint of the Keras
optimizer keeps the choice. The model is tests/mp/test_tf_algorithms.py's quadratic one (plain
SGD: no optimizer state besides the weights). With a decentralized candidate listed (the ranks'
models then differ), each rank's training after the choice must equal the simulation (torch)
of the chosen algorithm by tests/reference_algorithms.py from every rank's weights at the
switch.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")

import auto_cases  # noqa: E402
import reference_algorithms as ra  # noqa: E402
from quadratic import TorchQuadratic, torch_loss  # noqa: E402

import bagua_hvd.tensorflow as hvd  # noqa: E402
from bagua_hvd.common.auto_algorithm import TEST_DELAY_ENV  # noqa: E402
from bagua_hvd.tensorflow import algorithms as A  # noqa: E402

IN, HIDDEN, OUT = 6, 16, 3
SHAPES = [(IN, HIDDEN), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (HIDDEN, OUT), (OUT,)]
LR = 2.0**-5
WARMUP, PER, ROUNDS = 1, 3, 2  # ROUNDS: Auto's default
DECISION = WARMUP + ROUNDS * 2 * (PER + 1)  # the first step of the chosen candidate (of two)
AFTER = 4
DELAY = "0.1"
RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def tf_init():
    hvd.init()
    yield


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.001")
    monkeypatch.delenv("BAGUA_HVD_ALGORITHM", raising=False)
    monkeypatch.delenv(TEST_DELAY_ENV, raising=False)


def init_values():
    rng = np.random.default_rng(1234)
    return [rng.normal(0, 0.5, s).astype(np.float32) for s in SHAPES]


def data_of(rank, step):
    rng = np.random.default_rng(1000 * rank + step + 1)
    a = [rng.uniform(0.5, 1.5, s).astype(np.float32) for s in SHAPES]
    c = [rng.normal(0, 1, s).astype(np.float32) for s in SHAPES]
    return a, c


def data(step):
    return data_of(hvd.rank(), step)


def loss_of(variables, a, c):
    return tf.add_n(
        [tf.reduce_sum(0.5 * ai * tf.square(v) + ci * v) for v, ai, ci in zip(variables, a, c)]
    )


def auto(**kw):
    return A.Auto(
        [A.GradientAllReduce(), A.ByteGrad(error_feedback=True)],
        warmup_steps=WARMUP,
        steps_per_candidate=PER,
        **kw,
    )


def tape_loop(variables, algorithm, eager=False):
    opt = tf.keras.optimizers.SGD(LR)

    def step(a, c):
        with tf.GradientTape() as tape:
            loss = loss_of(variables, a, c)
        tape = hvd.DistributedGradientTape(tape, algorithm=algorithm)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        tape.step_done()
        return loss

    return step if eager else tf.function(step)


def keras_loop(variables, algorithm):
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR), algorithm=algorithm)

    @tf.function
    def step(a, c):
        with tf.GradientTape() as tape:
            loss = loss_of(variables, a, c)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return loss

    return opt, step


def train(step, first, count):
    for t in range(first, first + count):
        a, c = data(t)
        step(a, c)


def same_on_every_rank(values):
    got = hvd.allgather_object(values)
    assert all(v == got[0] for v in got), f"the ranks differ: {got}"


def compare(variables, want, what):
    for i, (v, w) in enumerate(zip(variables, want)):
        got, w = v.numpy().astype(np.float64), w.numpy().astype(np.float64)
        err, scale = np.abs(got - w).max(), np.abs(w).max()
        assert err <= RTOL * max(scale, 1e-30), f"{what}: variable {i} differs by {err:.3g}"


@pytest.mark.parametrize(
    "slow,expected,alone,eager",
    [
        ("ByteGrad", "GradientAllReduce", lambda: A.GradientAllReduce(), False),
        ("GradientAllReduce", "ByteGrad", lambda: A.ByteGrad(error_feedback=True), False),
        ("GradientAllReduce", "ByteGrad", lambda: A.ByteGrad(error_feedback=True), True),
    ],
    ids=["slow-bytegrad", "slow-gradient-allreduce", "slow-gradient-allreduce-eager"],
)
def test_tape_auto_chooses_the_faster_and_trains_as_it(
    monkeypatch, capfd, slow, expected, alone, eager
):
    monkeypatch.setenv(TEST_DELAY_ENV, f"{slow}:{DELAY}")
    variables = [tf.Variable(x) for x in init_values()]
    alg = auto()
    step = tape_loop(variables, alg, eager)
    train(step, 0, DECISION)
    assert alg.chosen is None, "decided before every candidate was measured"
    start = [v.numpy() for v in variables]
    train(step, DECISION, AFTER)
    state = alg.state_dict()
    assert type(alg.chosen).__name__ == expected, state
    assert state["chosen_step"] == DECISION
    same_on_every_rank(state)
    printed = capfd.readouterr().out
    if hvd.rank() == 0:
        assert printed.count("bagua_hvd auto: chose") == 1, printed
        assert f"chose {expected} from step {DECISION}" in printed, printed
    else:
        assert "bagua_hvd auto" not in printed
    same_on_every_rank([v.numpy().tolist() for v in variables])
    # The chosen algorithm alone, from the same weights, on the same data.
    monkeypatch.delenv(TEST_DELAY_ENV)
    ref = [tf.Variable(x) for x in start]
    train(tape_loop(ref, alone(), eager), DECISION, AFTER)
    compare(variables, ref, f"auto -> {expected}")


def test_keras_optimizer_auto_and_checkpoint(monkeypatch, tmp_path_factory):
    monkeypatch.setenv(TEST_DELAY_ENV, f"ByteGrad:{DELAY}")
    variables = [tf.Variable(x) for x in init_values()]
    alg = auto()
    opt, step = keras_loop(variables, alg)
    train(step, 0, DECISION + 1)
    assert isinstance(alg.chosen, A.GradientAllReduce), alg.state_dict()
    # Every rank saves (into its own directory); the checkpoint keeps the choice.
    path = tf.train.Checkpoint(optimizer=opt).save(tempfile.mkdtemp() + "/ckpt")
    monkeypatch.setenv(TEST_DELAY_ENV, f"GradientAllReduce:{DELAY}")  # measuring would differ
    alg2 = auto(verbose=False)
    variables2 = [tf.Variable(v.numpy()) for v in variables]
    opt2, step2 = keras_loop(variables2, alg2)
    tf.train.Checkpoint(optimizer=opt2).restore(path)
    train(step2, DECISION + 1, 2)
    state = alg2.state_dict()
    assert state["chosen"] == 0 and state["chosen_step"] == DECISION, state
    assert isinstance(alg2.chosen, A.GradientAllReduce)


def test_auto_by_name_and_bad_inputs():
    variables = [tf.Variable(x) for x in init_values()]
    tape_loop(variables, "auto")  # builds nothing until the first step
    alg = A.environment_algorithm("auto")
    assert [type(c).__name__ for c in alg.candidates] == ["GradientAllReduce", "ByteGrad"]
    with pytest.raises(ValueError, match="candidates is empty"):
        A.Auto([])
    with pytest.raises(ValueError, match="unknown candidate 'fast'"):
        A.Auto(["bytegrad", "fast"])
    with pytest.raises(ValueError, match="needs its own optimizer"):
        A.Auto(["gradient_allreduce", "qadam"])
    q = A.QAdamOptimizer(warmup_steps=2)
    with pytest.raises(ValueError, match="QAdamAlgorithm cannot be a candidate"):
        A.Auto([A.QAdamAlgorithm(q)])
    with pytest.raises(ValueError, match="QAdamAlgorithm goes with QAdamOptimizer"):
        hvd.DistributedOptimizer(q, algorithm="auto")
    with pytest.raises(ValueError, match='algorithms or "auto", got .fastest.'):
        hvd.DistributedOptimizer(tf.keras.optimizers.SGD(LR), algorithm="fastest")


def from_three_ranks(fn):
    """Collects ``fn`` from 3 ranks on (the launcher's size, known at collection time): where
    shift_one's pairs change from round to round and the ring's two neighbours differ."""
    return fn if int(os.environ.get("HOROVOD_SIZE", "1")) >= 3 else None


# Two of torch's four cases (tests/mp/test_torch_auto.py), at 3 ranks only, to keep the jobs
# short: the switch to the decentralized SGD (its rounds counted from the decision) and the
# switch away from the low-precision ring (an exchange may still be in flight).
@from_three_ranks
@pytest.mark.parametrize(
    "name,slow_decentralized",
    [("decentralized", False), ("low_precision_decentralized", True)],
    ids=["to-decentralized", "from-low-precision-decentralized"],
)
def test_tape_auto_with_a_decentralized_candidate(monkeypatch, capfd, name, slow_decentralized):
    """``Auto([GradientAllReduce(), <decentralized>])`` in a DistributedGradientTape inside
    ``tf.function``, one of them made slow: the other is chosen, every rank runs the same
    candidate at every step (the documented schedule), and after the switch (to or from the
    decentralized algorithm, whose measurement left the ranks' models different) each rank's
    weights equal the reference's rank, simulated from every rank's weights at the switch:
    the chosen algorithm alone from there, with its state fresh (round 0, new replicas)."""
    case = auto_cases.case(name, slow_decentralized)
    monkeypatch.setenv(TEST_DELAY_ENV, f"{case.slow}:{DELAY}")
    variables = [tf.Variable(x) for x in init_values()]
    alg = A.Auto(
        [A.GradientAllReduce(), case.decentralized()], warmup_steps=WARMUP, steps_per_candidate=PER
    )
    step = tape_loop(variables, alg)
    keys = []  # (candidate, final) of each step
    for t in range(DECISION + AFTER):
        if t == DECISION:
            start = hvd.allgather_object([v.numpy() for v in variables])
        train(step, t, 1)
        schedule = A.tape_impl(alg, hvd.global_process_set).schedule
        keys.append((schedule.current, schedule.chosen is not None))
    assert keys == auto_cases.schedule(case.chosen, WARMUP, PER, ROUNDS, AFTER), keys
    same_on_every_rank(keys)
    state = alg.state_dict()
    assert type(alg.chosen).__name__ == case.expected, state
    assert state["chosen_step"] == DECISION, state
    printed = capfd.readouterr().out
    if hvd.rank() == 0:
        assert printed.count("bagua_hvd auto: chose") == 1, printed
        assert f"chose {case.expected} from step {DECISION}" in printed, printed
    # The decentralized measurement (steps 5-8 and 13-16) left the ranks' models different.
    assert any(any((x != y).any() for x, y in zip(s, start[0])) for s in start[1:])
    ref = ra.ReferenceCluster(
        case.reference, hvd.size(), lambda r: TorchQuadratic(start[r]), torch_loss,
        lambda ps: torch.optim.SGD(ps, lr=LR), **case.reference_kwargs,
    )  # fmt: skip
    for t in range(DECISION, DECISION + AFTER):
        ref.step([data_of(r, t) for r in range(hvd.size())])
    want = [tf.constant(p.numpy()) for p in ref.parameters()[hvd.rank()]]
    compare(variables, want, f"auto -> {case.expected}")
