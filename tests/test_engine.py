"""The framework-neutral algorithm engine (bagua_hvd/common/engine.py) and the declarations'
checks (bagua_hvd/common/algorithms.py), without a core (torch only for its dtypes, which the
reference's layouts are keyed by): bucketing against the independent reference, the op names on
the wire, and what each declaration asks for. The
primitives themselves run in the multi-process tests (tests/mp/test_*_algorithms.py)."""

from __future__ import annotations

import random

import pytest
import reference_algorithms as ra
import torch

from bagua_hvd.common import algorithms as alg
from bagua_hvd.common import engine, ops

DTYPES = [torch.float32, torch.float16, torch.float64, torch.bfloat16]


@pytest.mark.parametrize("seed", range(20))
def test_bucket_layout_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    params = [
        (rng.choice([1, 3, 5, 10, 25, 50, 100, 1000]), rng.choice(DTYPES))
        for _ in range(rng.randint(1, 12))
    ]
    infos = [(n, dt, torch.empty((), dtype=dt).element_size()) for n, dt in params]
    # 40 and 200 bytes are often met exactly: a tensor that fills a bucket to the cap joins it
    for cap in (0, 40, 64, 200, 1000, 1 << 20):
        assert engine.bucket_layout(infos, cap) == ra.bucket_layout_for(params, cap)
        order = list(range(len(params)))
        rng.shuffle(order)
        got = engine.bucket_layout(infos, cap, order=order)
        assert got == ra.bucket_layout_for(params, cap, order=order)


def test_bucket_labels_and_op_names() -> None:
    assert engine.bucket_label("fc.weight", 1) == "fc.weight"
    assert engine.bucket_label("fc.weight", 3) == "fc.weight+2"
    torch_names = engine.LabelledNames(["fc.bias+1", "conv.weight"])
    assert torch_names.op("peer", 0) == "decentralized.fc.bias+1"
    assert torch_names.op("lp.init", 1) == "lpdec.init.conv.weight"
    assert torch_names.op("lp.step", 0) == "lpdec.fc.bias+1"
    assert torch_names.op("lp.x", 1) == "lpdec.x.conv.weight"
    # Averagers: the core adds the elastic generation and the restarts (async_impl_test.cc).
    assert torch_names.averager_prefix() == "async.fc.bias+1"
    tf_names = engine.NumberedNames(7)
    assert tf_names.op("grad", 0) == "allreduce.bagua_tf7.grad.0"
    assert tf_names.op("momentum", 2) == "allreduce.bagua_tf7.momentum.2"
    assert tf_names.op("peer", 1) == "decentralized.bagua_tf7.w.1"
    assert tf_names.op("lp.init", 0) == "lp_decentralized.bagua_tf7.init.0"
    assert tf_names.op("lp.step", 0) == "lp_decentralized.bagua_tf7.step.0"
    assert tf_names.op("lp.x", 3) == "lp_decentralized.bagua_tf7.x.3"
    assert tf_names.op("steps", 0) == "counter.bagua_tf7.steps.0"
    assert tf_names.averager_prefix() == "async.bagua_tf7"


class _Q:
    """Stands in for a frontend's QAdamOptimizer."""

    warmup_steps = 3


class _OtherOptimizer:
    pass


def test_declarations_say_what_they_need() -> None:
    alg.register_qadam_optimizer(_Q)
    q = alg.QAdamAlgorithm(_Q())
    cases = [
        (alg.GradientAllReduce(), ops.Average, True, None, True),
        (alg.GradientAllReduce(hierarchical=True, average=False), ops.Sum, False, None, True),
        (alg.ByteGrad(average=False), ops.Sum, False, None, True),
        (alg.Decentralized(), ops.Max, False, "peer_average", False),
        (alg.LowPrecisionDecentralized(), ops.Max, False, "low_precision_ring", False),
        (alg.AsyncModelAverage(), ops.Max, False, "async", True),
        (q, ops.Max, False, None, True),
    ]
    for a, op, horovod, weights, gradient_path in cases:
        assert a.reduce_op(ops.Max) == op, a
        assert a.is_horovod_allreduce() is horovod, a
        assert a.weight_averaging == weights, a
        assert a.uses_gradient_path is gradient_path, a
    assert (
        alg.ByteGrad().compresses_gradients(0) and alg.ByteGrad(error_feedback=True).error_feedback
    )
    assert not alg.GradientAllReduce().error_feedback and not alg.Decentralized().error_feedback
    # QAdam's stages follow its optimizer's updates: warm-up, then the compressed momentum.
    assert q.staged_by_optimizer and not alg.ByteGrad().staged_by_optimizer
    assert [q.compresses_gradients(s) for s in range(5)] == [False, False, False, True, True]
    assert [q.sends_momentum(s) for s in range(5)] == [False, False, False, True, True]
    assert alg.AsyncModelAverage(warmup_steps=2).communicates_gradients(1)
    assert not alg.AsyncModelAverage(warmup_steps=2).communicates_gradients(2)


def test_gradient_path_plans() -> None:
    alg.register_qadam_optimizer(_Q)

    def plans(a: alg.Algorithm, steps: int) -> list:
        path = engine.GradientPath(a, None, None)
        return [tuple(path.plan(s))[1:] for s in range(steps)]

    # (communicates, momentum, primitive, compressed, residuals)
    assert plans(alg.GradientAllReduce(), 1) == [(True, False, False, False, False)]
    assert plans(alg.GradientAllReduce(hierarchical=True), 1) == [(True, False, True, False, False)]
    assert plans(alg.ByteGrad(hierarchical=False), 1) == [(True, False, True, True, False)]
    assert plans(alg.ByteGrad(error_feedback=True), 1) == [(True, False, True, True, True)]
    warm, comp = (True, False, True, False, False), (True, True, True, True, True)
    q = alg.QAdamAlgorithm(_Q(), error_feedback=True)
    assert plans(q, 5) == [warm, warm, warm, comp, comp]
    off = (False, False, False, False, False)
    assert plans(alg.AsyncModelAverage(warmup_steps=1), 2) == [(True,) + off[1:], off]
    assert plans(alg.Decentralized(), 1) == [(False, False, True, False, False)]


def test_gradient_path_stages_cover_every_step() -> None:
    """stages() (what a graph frontend plans at trace time): each stage's plan is the plan of
    every step from its first step to the next stage's."""
    alg.register_qadam_optimizer(_Q)
    cases = [
        alg.GradientAllReduce(hierarchical=True),
        alg.ByteGrad(error_feedback=True),
        alg.QAdamAlgorithm(_Q(), error_feedback=True),
        alg.AsyncModelAverage(warmup_steps=2),
        alg.AsyncModelAverage(warmup_steps=0),
        alg.Decentralized(),
    ]
    for a in cases:
        path = engine.GradientPath(a, None, None)
        stages = path.stages()
        assert stages[0][0] == 0, a
        firsts = [f for f, _ in stages]
        assert firsts == sorted(set(firsts)), a
        for s in range(8):
            current = [p for f, p in stages if f <= s][-1]
            assert tuple(current)[1:] == tuple(path.plan(s))[1:], (a, s)
    assert [f for f, _ in engine.GradientPath(cases[2], None, None).stages()] == [0, 3]


def test_weight_decisions_take_ints_and_step_tensors() -> None:
    """The weight algorithms' step decisions are plain expressions of the step, so the same
    code answers for an int (eager, torch) and for a graph's step count."""
    names = engine.NumberedNames(0)
    dec = engine.PeerAverage(alg.Decentralized(communication_interval=3), None, names, None, int)
    assert [dec.communicating(s) for s in range(7)] == [s % 3 == 0 for s in range(7)]
    assert [dec.round(s) for s in (0, 3, 6)] == [0, 1, 2]
    ring_alg = alg.LowPrecisionDecentralized(communication_interval=2)
    ring = engine._WEIGHT_AVERAGING["low_precision_ring"](ring_alg, None, names, None, int)
    assert [ring.communicating(s) for s in range(4)] == [True, False, True, False]
    avg = engine.AsyncAveraging(alg.AsyncModelAverage(warmup_steps=2), None, names, None, int)
    assert [avg.averages(s) for s in range(4)] == [False, False, True, True]
    t = torch.tensor(6)
    assert bool(dec.communicating(t)) and int(dec.round(t)) == 2 and bool(avg.averages(t))
    assert names.averager_prefix() == "async.bagua_tf0"


def test_declarations_check_their_optimizer_and_options() -> None:
    alg.register_qadam_optimizer(_Q)
    mismatch = "QAdamAlgorithm goes with QAdamOptimizer"
    with pytest.raises(ValueError, match="must be an object from bagua_hvd.torch.algorithms"):
        alg.check_algorithm("bytegrad", "torch")
    with pytest.raises(ValueError, match=mismatch):
        alg.ByteGrad().check(_Q(), _Q)
    with pytest.raises(ValueError, match=mismatch + r".*\)$"):
        alg.QAdamAlgorithm(_Q()).check(_OtherOptimizer(), _Q)
    with pytest.raises(ValueError, match="this QAdamOptimizer is torch's"):
        alg.QAdamAlgorithm(_Q()).check(None, _OtherOptimizer)
    with pytest.raises(ValueError, match=r"algorithm=ByteGrad\(...\) decides how data"):
        alg.ByteGrad().check(_OtherOptimizer(), _Q, compression=True)
    with pytest.raises(ValueError, match=r"algorithm=Decentralized\(...\) decides how data"):
        alg.Decentralized().check(_OtherOptimizer(), _Q, groups=2)
    alg.GradientAllReduce().check(_OtherOptimizer(), _Q, compression=True, groups=2)
    alg.QAdamAlgorithm(_Q()).check(None, _Q)
