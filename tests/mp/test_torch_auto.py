"""algorithm="auto" in hvd.DistributedOptimizer, run by every rank of a launched job
(tests/test_auto_algorithm.py launches it at 2 and 3 ranks).

A candidate is made slow through the engine's test hook (BAGUA_HVD_TEST_ALGORITHM_DELAY), so
the other one must be chosen; every rank must choose the same candidate at the same step; the
training after the choice must equal the chosen algorithm run alone from the same state; the
choice must survive a state_dict round trip.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import bagua_hvd.torch as hvd
from bagua_hvd.common.auto_algorithm import TEST_DELAY_ENV
from bagua_hvd.torch import algorithms as A

IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8
WARMUP, PER = 1, 3
DECISION = WARMUP + 2 * (PER + 1)  # the first step of the chosen candidate (two candidates)
AFTER = 4  # steps compared with the chosen algorithm alone
DELAY = "0.1"
RTOL = 1e-5


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    # Several buckets per model: per-bucket state (residuals) is exercised.
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.001")
    monkeypatch.delenv("BAGUA_HVD_ALGORITHM", raising=False)
    monkeypatch.delenv(TEST_DELAY_ENV, raising=False)


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(step: int):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        x, y = batch(step)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def make_opt(model, algorithm):
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(), algorithm=algorithm
    )


def auto(**kw):
    return A.Auto(
        [A.GradientAllReduce(), A.ByteGrad(error_feedback=True)],
        warmup_steps=WARMUP,
        steps_per_candidate=PER,
        **kw,
    )


def same_on_every_rank(values):
    got = hvd.allgather_object(values)
    assert all(v == got[0] for v in got), f"the ranks differ: {got}"


def compare(model, want, what):
    for i, (a, b) in enumerate(zip(model.parameters(), want.parameters())):
        scale = b.detach().abs().max().item()
        err = (a.detach() - b.detach()).abs().max().item()
        assert err <= RTOL * max(scale, 1e-30), f"{what}: parameter {i} differs by {err:.3g}"


@pytest.mark.parametrize(
    "slow,expected,alone",
    [
        ("ByteGrad", "GradientAllReduce", lambda: A.GradientAllReduce()),
        ("GradientAllReduce", "ByteGrad", lambda: A.ByteGrad(error_feedback=True)),
    ],
    ids=["slow-bytegrad", "slow-gradient-allreduce"],
)
def test_auto_chooses_the_faster_and_trains_as_it(monkeypatch, capsys, slow, expected, alone):
    monkeypatch.setenv(TEST_DELAY_ENV, f"{slow}:{DELAY}")
    model = make_model()
    alg = auto()
    opt = make_opt(model, alg)
    train(model, opt, DECISION)
    schedule = opt._algo_impl.schedule
    assert schedule.chosen is None, "decided before every candidate was measured"
    # The state the chosen candidate starts from (this rank's).
    start_model = copy.deepcopy(model.state_dict())
    start_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, AFTER, first=DECISION)
    assert type(alg.chosen).__name__ == expected, schedule.table()
    assert schedule.chosen_step == DECISION
    same_on_every_rank((schedule.chosen, schedule.chosen_step, schedule.step_times))
    printed = capsys.readouterr().out
    if hvd.rank() == 0:
        assert printed.count("bagua_hvd auto: chose") == 1, printed
        assert f"chose {expected} from step {DECISION}" in printed, printed
    else:
        assert "bagua_hvd auto" not in printed
    # Every rank's model is the same (both candidates average the gradients).
    same_on_every_rank([p.detach().tolist() for p in model.parameters()])
    # The chosen algorithm alone, from the same state, on the same batches.
    monkeypatch.delenv(TEST_DELAY_ENV)
    ref = make_model()
    ref.load_state_dict(start_model)
    ref_opt = make_opt(ref, alone())
    ref_opt.load_state_dict(start_opt)
    train(ref, ref_opt, AFTER, first=DECISION)
    compare(model, ref, f"auto -> {expected}")


def test_gradient_allreduce_after_the_choice_is_averaged_sgd(monkeypatch):
    """An independent reference: after the choice of GradientAllReduce, each step is SGD with
    momentum on the gradient averaged over the ranks (computed here with allgather)."""
    monkeypatch.setenv(TEST_DELAY_ENV, f"ByteGrad:{DELAY}")
    model = make_model()
    opt = make_opt(model, auto())
    train(model, opt, DECISION)
    ref = copy.deepcopy(model)
    ref_sgd = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_sgd.load_state_dict(
        {k: v for k, v in copy.deepcopy(opt.state_dict()).items() if k != "bagua_hvd_auto"}
    )
    train(model, opt, AFTER, first=DECISION)
    assert isinstance(opt._algo_impl.schedule.alg.chosen, A.GradientAllReduce)
    for step in range(DECISION, DECISION + AFTER):
        grads = []
        for r in range(hvd.size()):
            ref_sgd.zero_grad()
            g = torch.Generator().manual_seed(1000 * r + step)
            x, y = torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)
            ((ref(x) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / hvd.size()
        ref_sgd.step()
    compare(model, ref, "GradientAllReduce after auto vs averaged SGD")


def test_state_dict_keeps_the_choice(monkeypatch):
    monkeypatch.setenv(TEST_DELAY_ENV, f"GradientAllReduce:{DELAY}")
    model = make_model()
    opt = make_opt(model, auto())
    train(model, opt, DECISION + 1)
    state = opt.state_dict()
    assert state["bagua_hvd_auto"]["chosen"] == 1
    assert state["bagua_hvd_auto"]["candidates"] == ["GradientAllReduce", "ByteGrad"]
    # Restored into a new optimizer: the saved choice from the first step, nothing measured
    # (the delay now makes ByteGrad slow: a new measurement would choose the other one).
    monkeypatch.setenv(TEST_DELAY_ENV, f"ByteGrad:{DELAY}")
    model2 = make_model()
    model2.load_state_dict(model.state_dict())
    opt2 = make_opt(model2, auto(verbose=False))
    opt2.load_state_dict(copy.deepcopy(state))
    train(model2, opt2, 2)
    impl = opt2._algo_impl
    assert impl._key == (1, True) and isinstance(impl.impl.alg, A.ByteGrad)
    assert impl.schedule.chosen_step == DECISION
    assert all(not t for t in impl.schedule._times)


def test_restored_on_rank_0_only_before_the_first_step(monkeypatch):
    """Rank 0 restores the checkpoint; the others take its choice at the first step."""
    model = make_model()
    opt = make_opt(model, auto(verbose=False))
    if hvd.rank() == 0:
        state = opt.state_dict()
        state["bagua_hvd_auto"] = dict(state["bagua_hvd_auto"], chosen=1, chosen_step=7)
        opt.load_state_dict(state)
    train(model, opt, 1)
    assert opt._algo_impl.schedule.chosen == 1 and opt._algo_impl.schedule.chosen_step == 7


def test_bad_inputs():
    model = make_model()
    with pytest.raises(ValueError, match="candidates is empty"):
        A.Auto([])
    with pytest.raises(ValueError, match="unknown candidate 'fast'"):
        A.Auto(["bytegrad", "fast"])
    with pytest.raises(ValueError, match="needs its own optimizer"):
        A.Auto(["qadam"])
    q = A.QAdamOptimizer(model.parameters(), warmup_steps=2)
    with pytest.raises(ValueError, match="QAdamAlgorithm cannot be a candidate"):
        A.Auto([A.QAdamAlgorithm(q), A.ByteGrad()])
    with pytest.raises(ValueError, match="AsyncModelAverage cannot be a candidate"):
        A.Auto([A.AsyncModelAverage()])
    with pytest.raises(ValueError, match="disagree on average"):
        A.Auto([A.GradientAllReduce(), A.ByteGrad(average=False)])
    b = A.ByteGrad()
    with pytest.raises(ValueError, match="listed twice"):
        A.Auto([b, b])
    with pytest.raises(ValueError, match="steps_per_candidate must be an integer >= 1"):
        A.Auto(steps_per_candidate=0)
    with pytest.raises(ValueError, match="must be an algorithm"):
        A.Auto([3])
    with pytest.raises(ValueError, match='algorithms or "auto", got .fastest.'):
        make_opt(model, "fastest")
    with pytest.raises(ValueError, match="QAdamAlgorithm goes with QAdamOptimizer"):
        hvd.DistributedOptimizer(q, algorithm="auto")
    with pytest.raises(ValueError, match="compression= or groups="):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            algorithm="auto",
            compression=hvd.Compression.fp16,
        )


def test_auto_by_name_uses_the_default_candidates():
    model = make_model()
    opt = make_opt(model, "auto")
    alg = opt._algo_impl.alg
    assert [type(c).__name__ for c in alg.candidates] == ["GradientAllReduce", "ByteGrad"]
    assert (alg.warmup_steps, alg.steps_per_candidate) == (2, 5)
