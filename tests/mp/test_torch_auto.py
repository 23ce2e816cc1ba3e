"""algorithm="auto" in hvd.DistributedOptimizer, run by every rank of a launched job
(tests/test_auto_algorithm.py launches it at 2 and 3 ranks).

A candidate is made slow through the engine's test hook (BAGUA_HVD_TEST_ALGORITHM_DELAY), so
the other one must be chosen; every rank must choose the same candidate at the same step; the
training after the choice must equal the chosen algorithm run alone from the same state; the
choice must survive a state_dict round trip. With a decentralized candidate listed (the ranks'
models then differ), each rank's training after the choice must equal the simulation of the
chosen algorithm by tests/reference_algorithms.py from every rank's state at the switch.
"""

from __future__ import annotations

import copy

import auto_cases
import pytest
import reference_algorithms as ra
import torch
from torch import nn

import bagua_hvd.torch as hvd
from bagua_hvd.common.auto_algorithm import TEST_DELAY_ENV
from bagua_hvd.torch import algorithms as A

IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8
WARMUP, PER, ROUNDS = 1, 3, 2  # ROUNDS: Auto's default
DECISION = WARMUP + ROUNDS * 2 * (PER + 1)  # the first step of the chosen candidate (of two)
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


def batch_of(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def batch(step: int):
    return batch_of(hvd.rank(), step)


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


def test_a_slow_round_does_not_decide(monkeypatch):
    """GradientAllReduce slowed by 0.3 s a step in the first round only, ByteGrad by 0.1 s in
    both: a candidate's time is the smallest of its rounds' medians, so GradientAllReduce is
    chosen. (The median of all its measured steps, half of them 0.3 s, would choose
    ByteGrad.)"""
    model = make_model()
    opt = make_opt(model, auto(verbose=False))
    second_round = WARMUP + 2 * (PER + 1)
    for step in range(DECISION + 1):
        slow = "GradientAllReduce:0.3," if step < second_round else ""
        monkeypatch.setenv(TEST_DELAY_ENV, f"{slow}ByteGrad:0.1")
        train(model, opt, 1, first=step)
    schedule = opt._algo_impl.schedule
    assert schedule.chosen == 0, schedule.table()
    assert schedule.step_times[0] < 0.1 < schedule.step_times[1] < 0.3, schedule.table()
    assert schedule.measured == ROUNDS * 2 * PER


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
    assert impl.schedule.measured == 0


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
    with pytest.raises(ValueError, match="rounds must be an integer >= 1"):
        A.Auto(rounds=0)
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
    assert (alg.warmup_steps, alg.steps_per_candidate, alg.rounds) == (2, 3, 2)


@pytest.mark.parametrize("slow_decentralized", [False, True], ids=["to", "from"])
@pytest.mark.parametrize("name", auto_cases.NAMES)
def test_auto_with_a_decentralized_candidate(monkeypatch, capsys, name, slow_decentralized):
    """``Auto([GradientAllReduce(), <decentralized>])`` with one of them made slow: the other
    is chosen, every rank runs the same candidate at every step (the documented schedule), and
    after the switch (to or from the decentralized algorithm, whose measurement left the
    ranks' models different) each rank's weights equal the reference's rank, simulated from
    every rank's weights and momentum at the switch: the chosen algorithm alone from there,
    with its state fresh (round 0, new replicas)."""
    case = auto_cases.case(name, slow_decentralized)
    monkeypatch.setenv(TEST_DELAY_ENV, f"{case.slow}:{DELAY}")
    model = make_model()
    alg = A.Auto(
        [A.GradientAllReduce(), case.decentralized()], warmup_steps=WARMUP, steps_per_candidate=PER
    )
    opt = make_opt(model, alg)
    keys = []  # (candidate, final) of each step, as the optimizer ran it
    for step in range(DECISION + AFTER):
        if step == DECISION:
            # Every rank's state at the switch (the ranks' models differ by now).
            start = hvd.allgather_object(
                (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
            )
        train(model, opt, 1, first=step)
        keys.append(opt._algo_impl._key)
    assert keys == auto_cases.schedule(case.chosen, WARMUP, PER, ROUNDS, AFTER), keys
    same_on_every_rank(keys)
    assert type(alg.chosen).__name__ == case.expected, opt._algo_impl.schedule.table()
    assert opt._algo_impl.schedule.chosen_step == DECISION
    printed = capsys.readouterr().out
    if hvd.rank() == 0:
        assert printed.count("bagua_hvd auto: chose") == 1, printed
        assert f"chose {case.expected} from step {DECISION}" in printed, printed
    # The decentralized measurement (steps 5-8 and 13-16) left the ranks' models different.
    first = [p.tolist() for p in start[0][0].values()]
    assert any([p.tolist() for p in s[0].values()] != first for s in start[1:])

    def start_model(rank: int) -> nn.Module:
        m = make_model()
        m.load_state_dict(start[rank][0])
        return m

    ref = ra.ReferenceCluster(
        case.reference, hvd.size(), start_model, ra.mse_loss,
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), **case.reference_kwargs,
    )  # fmt: skip
    for r, ref_opt in enumerate(ref.optimizers):
        ref_opt.load_state_dict({k: v for k, v in start[r][1].items() if k != "bagua_hvd_auto"})
    for step in range(DECISION, DECISION + AFTER):
        ref.step([batch_of(r, step) for r in range(hvd.size())])
    want = ref.parameters()[hvd.rank()]
    for i, (a, b) in enumerate(zip(model.parameters(), want)):
        scale = b.abs().max().item()
        err = (a.detach() - b).abs().max().item()
        assert err <= RTOL * max(scale, 1e-30), f"auto -> {case.expected}: parameter {i}, {err:.3g}"
