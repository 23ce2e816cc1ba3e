"""BAGUA's algorithms through hvd.DistributedOptimizer(algorithm=...), run by every rank of a
launched job (or alone at size 1, where HOROVOD_ELASTIC=1 makes the optimizer take its
multi-rank path).

Each rank trains its replica on its own batches and compares its final weights with
tests/reference_algorithms.py, which simulates every rank in one process from the math of
docs/algorithms.md without calling the core. Synchronous algorithms must agree within 1e-5
relative (per tensor: max |got - want| <= 1e-5 * max |want|); the compressed ones agree
bit for bit in practice (same bits into the same deterministic quantizer), the tolerance covers
the full-precision sums, which the core adds in ring order.
"""

from __future__ import annotations

import gc

import pytest
import reference_algorithms as ra
import torch
from torch import nn
from unnamed_ops import check_unnamed_ops, train_until_every_rank_averaged

import bagua_hvd.torch as hvd
from bagua_hvd.common.primitives import Request, lp_ring_pending
from bagua_hvd.torch import algorithms as A

STEPS = 5
RTOL = 1e-5
IN, HIDDEN, OUT, BATCH = 6, 16, 3, 8


@pytest.fixture(autouse=True)
def _hooks_at_every_size(monkeypatch):
    if hvd.size() == 1:
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    # Several buckets per model: chunking, padding and per-bucket state are exercised.
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.001")
    monkeypatch.delenv("BAGUA_HVD_ALGORITHM", raising=False)


def make_model(rank: int, dtypes=(torch.float32,) * 3, unused: bool = False) -> nn.Module:
    """The same initial weights on every rank (what broadcast_parameters gives)."""
    torch.manual_seed(1234)
    layers = [
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    ]
    for layer, dt in zip([layers[0], layers[2], layers[4]], dtypes):
        layer.to(dt)
    model = _Net(layers, dtypes)
    if unused:
        model.spare = nn.Linear(3, 3)  # never used in forward: no gradient on any rank
    return model


class _Net(nn.Module):
    def __init__(self, layers, dtypes) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.dtypes = dtypes

    def forward(self, x):
        for layer in self.layers:
            if isinstance(layer, nn.Linear):
                x = x.to(layer.weight.dtype)
            x = layer(x)
        return x.float()


def batches(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def loss_fn(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _train(model, opt, steps=STEPS):
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, batches(hvd.rank(), step)).backward()
        opt.step()


def _compare(model, want, what):
    got = [p for p in model.parameters() if p.requires_grad]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        scale = b.detach().float().abs().max().item()
        err = (a.detach().float() - b.detach().float()).abs().max().item()
        assert err <= RTOL * max(scale, 1e-30), (
            f"{what}: parameter {i} differs from the reference by {err:.3g} (scale {scale:.3g})"
        )


def _reference(algorithm, model_kwargs=None, opt_factory=sgd, steps=STEPS, **kwargs):
    model_kwargs = model_kwargs or {}
    return ra.run_reference(
        algorithm,
        hvd.size(),
        lambda r: make_model(r, **model_kwargs),
        batches,
        loss_fn,
        opt_factory,
        steps,
        **kwargs,
    )


SYNC_CASES = [
    ("gradient_allreduce", lambda: A.GradientAllReduce(), {}),
    ("gradient_allreduce", lambda: A.GradientAllReduce(average=False), {"average": False}),
    ("bytegrad", lambda: A.ByteGrad(), {}),
    ("bytegrad", lambda: A.ByteGrad(average=False), {"average": False}),
    ("bytegrad", lambda: A.ByteGrad(error_feedback=True), {"error_feedback": True}),
    (
        "decentralized",
        lambda: A.Decentralized(peer_selection_mode="all"),
        {"peer_selection_mode": "all"},
    ),
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


@pytest.mark.parametrize(
    "name,make_alg,kwargs",
    SYNC_CASES,
    ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[2].items())}" for c in SYNC_CASES],
)
def test_matches_reference(name, make_alg, kwargs):
    model = make_model(hvd.rank())
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(), algorithm=make_alg()
    )
    _train(model, opt)
    want = _reference(name, **kwargs).params[hvd.rank()]
    _compare(model, want, f"{name} {kwargs}")


@pytest.mark.parametrize(
    "name,make_alg,kwargs",
    [
        ("bytegrad", lambda: A.ByteGrad(error_feedback=True), {"error_feedback": True}),
        (
            "decentralized",
            lambda: A.Decentralized(peer_selection_mode="ring"),
            {"peer_selection_mode": "ring"},
        ),
        ("low_precision_decentralized", lambda: A.LowPrecisionDecentralized(), {}),
    ],
    ids=["bytegrad", "decentralized", "low_precision_decentralized"],
)
def test_mixed_dtypes_and_unused_parameters(name, make_alg, kwargs):
    """float32, bfloat16 and float16 layers in one model (one bucket per dtype) and a parameter
    that never gets a gradient."""
    mk = {"dtypes": (torch.float32, torch.bfloat16, torch.float16), "unused": True}
    model = make_model(hvd.rank(), **mk)
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters(), algorithm=make_alg()
    )
    _train(model, opt)
    want = _reference(
        name, model_kwargs=mk, layout_after_first_step=_final_layout(model, opt), **kwargs
    ).params[hvd.rank()]
    _compare(model, want, f"{name} mixed dtypes")


def _final_layout(model, opt):
    """The optimizer's gradient buckets after step 1, as parameter indices (the unused
    parameter, never observed ready, moves to the end of the order)."""
    index = {p: i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
    return [[index[p] for p in b.params] for b in opt._buckets]


@pytest.mark.parametrize("error_feedback", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_qadam_matches_reference(error_feedback, weight_decay):
    model = make_model(hvd.rank())
    q = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2, weight_decay=weight_decay)
    opt = hvd.DistributedOptimizer(
        q,
        named_parameters=model.named_parameters(),
        algorithm=A.QAdamAlgorithm(q, error_feedback=error_feedback),
    )
    _train(model, opt, steps=6)
    want = _reference(
        "qadam",
        opt_factory=None,
        steps=6,
        lr=0.01,
        warmup_steps=2,
        weight_decay=weight_decay,
        error_feedback=error_feedback,
    )
    _compare(model, want.params[hvd.rank()], "qadam")


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("piece", [7, 1 << 18], ids=["pieces", "default"])
def test_qadam_update_in_pieces_is_the_reference_bit_for_bit(piece, weight_decay, monkeypatch):
    """QAdamOptimizer's CPU update runs piece by piece over its tensors (no whole-tensor
    temporaries): every element still gets the reference's whole-tensor operations
    (tests/reference_algorithms.py), so the same bits, in warm-up and after it; without
    weight decay, a parameter without warm-up gradients (v == 0) does not move. Local (no
    communication)."""
    monkeypatch.setattr(A, "_PIECE", piece)
    torch.manual_seed(7)
    shapes = [(33, 5), (9,), (4, 4, 3)]
    params = [torch.randn(s, requires_grad=True) for s in shapes]
    mirror = [p.detach().clone() for p in params]
    start = params[1].detach().clone()
    q = A.QAdamOptimizer(params, lr=0.01, warmup_steps=3, weight_decay=weight_decay)
    want = ra.QAdamReference(mirror, lr=0.01, warmup_steps=3, weight_decay=weight_decay)
    for step in range(8):
        # the (9,) parameter has no gradient in warm-up: v == 0, it must not move after
        grads = [torch.randn(s) * float(i != 1 or step >= 3) for i, s in enumerate(shapes)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        q.step()
        if want.in_warmup(want.step_count + 1):
            want.adam_step([g.clone() for g in grads])
        else:
            want.momentum([g.clone() for g in grads])
            want.frozen_v_update()
        for i, (p, x) in enumerate(zip(params, mirror)):
            assert torch.equal(p.detach(), x), f"step {step}: parameter {i} differs"
    for p, m in zip(params, want.exp_avg):
        assert torch.equal(q.state[p]["exp_avg"], m)
    if weight_decay == 0:
        assert torch.equal(params[1].detach(), start)


def test_qadam_warmup_equals_adam_exactly():
    """Every rank trains on the same batches: the averaged gradient is the local one (exactly
    at sizes that are powers of two), so QAdam in warm-up is torch.optim.Adam bit for bit."""
    model = make_model(0)
    twin = make_model(0)
    q = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=100, weight_decay=0.01)
    opt = hvd.DistributedOptimizer(
        q, named_parameters=model.named_parameters(), algorithm=A.QAdamAlgorithm(q)
    )
    adam = torch.optim.Adam(twin.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(20):
        for m, o in ((model, opt), (twin, adam)):
            o.zero_grad()
            loss_fn(m, batches(0, step)).backward()
            o.step()
    exact = hvd.size() & (hvd.size() - 1) == 0
    for a, b in zip(model.parameters(), twin.parameters()):
        if exact:
            assert torch.equal(a, b)
        else:  # (g + g + g) / 3 may differ from g in the last bit
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_low_precision_replicas_are_consistent_bitwise():
    """My copy of my left neighbour equals its own replica, bit for bit, and my weights equal
    my own replica."""
    model = make_model(hvd.rank())
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()),
        named_parameters=model.named_parameters(),
        algorithm=A.LowPrecisionDecentralized(),
    )
    _train(model, opt)
    n, r = hvd.size(), hvd.rank()
    impl = opt._algo_impl
    impl.flush()  # the last exchange runs in the background
    if n == 1:
        assert impl.replicas is None  # no neighbours, no replicas
        return
    for i, flat in enumerate(impl.weights().flats):
        own, left, right = impl.replicas[i]
        assert torch.equal(flat, own)
        stacked = torch.stack([own, left, right])
        everyone = hvd.allgather(stacked.unsqueeze(0), name=f"lpdec.check.{i}")
        assert torch.equal(everyone[(r - 1) % n][0], left), "left replica differs"
        assert torch.equal(everyone[(r + 1) % n][0], right), "right replica differs"


def test_low_precision_exchange_is_left_in_flight_by_step(monkeypatch):
    """step() starts each bucket's exchange and returns without waiting for it (it overlaps the
    next step; docs/algorithms.md), with several buckets too."""
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    model = make_model(hvd.rank())
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()),
        named_parameters=model.named_parameters(),
        algorithm=A.LowPrecisionDecentralized(),
    )
    impl = opt._algo_impl
    # Every request waited for (wait() or settle()), held here: by identity, and alive so that
    # its id cannot be reused by a later request.
    waited = []
    for method in ("wait", "settle"):
        orig = getattr(Request, method)

        def spy(self, *args, _orig=orig, **kwargs):
            waited.append(self)
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(Request, method, spy)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(4, IN)).square().mean().backward()
        waited.clear()
        opt.step()
        if hvd.size() > 1:
            pending = impl.averaging.pending
            assert len(pending) == len(impl.weights().flats) > 1
            assert not any(r is w for r in pending for w in waited), f"step {step} waited for them"
    impl.flush()
    assert not impl.averaging.pending


def test_decentralized_ranks_agree_after_all_average():
    """With peer mode "all", the weights used in each step are the exact global average:
    after a final communicating step with zero learning rate every rank holds the same bits."""
    model = make_model(hvd.rank())
    base = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        algorithm=A.Decentralized(peer_selection_mode="all"),
    )
    _train(model, opt, steps=3)
    for g in base.param_groups:
        g["lr"] = 0.0
    _train(model, opt, steps=1)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="dec.all.agree")
    for k in range(hvd.size()):
        assert torch.equal(everyone[k], everyone[0])


def test_module_buffers_are_broadcast():
    """BAGUA never broadcast batch-norm statistics; Horovod's idiom does (state_dict)."""
    torch.manual_seed(hvd.rank())
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model(torch.randn(8, 4) + hvd.rank())  # running statistics differ per rank
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()),
        named_parameters=model.named_parameters(),
        algorithm=A.Decentralized(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for name, buf in model.named_buffers():
        everyone = hvd.allgather(buf.detach().reshape(1, -1).float(), name=f"buf.{name}")
        for k in range(hvd.size()):
            assert torch.equal(everyone[k], everyone[0]), f"buffer {name} differs on rank {k}"


def test_async_model_average_runs_rounds_and_stops():
    """Background rounds merge (float32 and bfloat16 weights), abort() stops them on every rank,
    resume() restarts them."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT)).to(dtype)
        alg = A.AsyncModelAverage(sync_interval_ms=5, warmup_steps=2)
        opt = hvd.DistributedOptimizer(
            sgd(model.parameters()), named_parameters=model.named_parameters(), algorithm=alg
        )
        import time

        deadline = time.monotonic() + 30
        step = 0
        impl = opt._algo_impl
        while time.monotonic() < deadline:
            opt.zero_grad()
            x, y = batches(hvd.rank(), step)
            loss_fn(model, (x.to(dtype), y)).backward()
            opt.step()
            step += 1
            if impl is None or (step > 10 and impl.rounds() >= 3):
                break
            time.sleep(0.002)
        if impl is not None:
            assert impl.rounds() >= 3, f"only {impl.rounds()} averaging rounds in {step} steps"
        alg.abort()
        assert all(torch.isfinite(p.float()).all() for p in model.parameters())
        if impl is not None:
            assert impl.id is None
            alg.resume()
            for _ in range(3):
                opt.zero_grad()
                x, y = batches(hvd.rank(), step)
                loss_fn(model, (x.to(dtype), y)).backward()
                opt.step()
            alg.abort()
        hvd.barrier()


def test_validation_messages(monkeypatch):
    model = make_model(0)
    with pytest.raises(ValueError, match="peer_selection_mode must be one of"):
        A.Decentralized(peer_selection_mode="star")
    with pytest.raises(ValueError, match="communication_interval must be a positive integer"):
        A.LowPrecisionDecentralized(communication_interval=0)
    with pytest.raises(ValueError, match="warmup_steps must be a positive integer"):
        A.QAdamOptimizer(model.parameters(), warmup_steps=0)
    with pytest.raises(ValueError, match="QAdamAlgorithm goes with QAdamOptimizer"):
        q = A.QAdamOptimizer(model.parameters())
        hvd.DistributedOptimizer(sgd(model.parameters()), algorithm=A.QAdamAlgorithm(q))
    with pytest.raises(ValueError, match="cannot be combined with compression"):
        hvd.DistributedOptimizer(
            sgd(model.parameters()), algorithm=A.ByteGrad(), compression=hvd.Compression.fp16
        )
    with pytest.raises(ValueError, match="algorithm must be an object"):
        hvd.DistributedOptimizer(sgd(model.parameters()), algorithm="bytegrad")
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "bytegrid")
    with pytest.raises(ValueError, match="unknown algorithm 'bytegrid'"):
        hvd.DistributedOptimizer(sgd(model.parameters()))
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "qadam")
    with pytest.raises(ValueError, match="QAdam needs its own optimizer"):
        hvd.DistributedOptimizer(sgd(model.parameters()))


def test_launcher_offers_every_named_algorithm():
    from bagua_hvd.runner.flags import ALGORITHM_NAMES

    assert list(ALGORITHM_NAMES) == list(A.BY_NAME)


def test_environment_selects_algorithm(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_ALGORITHM", "bytegrad")
    model = make_model(hvd.rank())
    opt = hvd.DistributedOptimizer(
        sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    assert isinstance(opt._algorithm, A.ByteGrad)
    # An optimizer's algorithm holds its state (QAdam its optimizer, async its averagers): the
    # environment gives each optimizer its own (only TensorFlow's per-step tapes share one).
    other = make_model(hvd.rank())
    opt2 = hvd.DistributedOptimizer(
        sgd(other.parameters()), named_parameters=other.named_parameters()
    )
    assert isinstance(opt2._algorithm, A.ByteGrad) and opt2._algorithm is not opt._algorithm
    _train(model, opt)
    _compare(model, _reference("bytegrad").params[hvd.rank()], "bytegrad from the environment")


def test_qadam_coordinates_without_gradient_do_not_move():
    """After warm-up, a coordinate whose second moment is 0 (no gradient during warm-up) keeps
    its value even when gradients reach it later: divided by eps alone, its momentum would
    throw the weight far away (docs/algorithms.md)."""
    torch.manual_seed(7)
    w = nn.Parameter(torch.randn(64))
    q = A.QAdamOptimizer([w], lr=0.01, warmup_steps=2)
    opt = hvd.DistributedOptimizer(q, named_parameters=[("w", w)], algorithm=A.QAdamAlgorithm(q))
    frozen = w.detach()[1::2].clone()
    for step in range(6):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * hvd.rank() + step)
        # The odd coordinates get gradients only after warm-up.
        used = w[::2] if step < 2 else w
        (used * torch.randn(used.numel(), generator=g)).sum().backward()
        opt.step()
    assert torch.equal(w.detach()[1::2], frozen)
    assert torch.isfinite(w).all() and w.detach().abs().max() < 10


def _revival_gradients(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s coefficients c of the loss c.w (+ curvature, see below) at ``step``: the
    even coordinates O(1), the odd ones 1e-6 times smaller (a unit that hardly fires in
    warm-up: its frozen second moment will be ~1e-12)."""
    g = torch.Generator().manual_seed(100 * rank + step)
    c = torch.randn(64, generator=g)
    c[1::2] *= 1e-6
    return c


def _revival_loss(w: torch.Tensor, rank: int, step: int, warmup: int) -> torch.Tensor:
    # After warm-up the odd coordinates "revive": a curvature 0.5 |w_odd|^2 reaches them.
    loss = (_revival_gradients(rank, step) * w).sum()
    if step >= warmup:
        loss = loss + 0.5 * (w[1::2] ** 2).sum()
    return loss


def test_qadam_stays_finite_where_the_frozen_second_moment_is_tiny():
    """The mechanism of the digits example's NaN (issue 11), at small size: coordinates whose
    warm-up gradients were tiny freeze a second moment v ~ 1e-12. After warm-up their averaged
    momentum is the 8-bit quantization error of their chunk (up to range/510, ~1e-3 here) and
    then a gradient that grew; divided by sqrt(v) it moved them by ~1e3 lr per step, and the
    curvature turned that into inf and NaN. Plain Adam on the same (averaged) gradients stays
    finite. QAdam must stay finite and move no coordinate by more than lr per step (its
    denominator is floored by |m| / (1 - beta1^s): docs/algorithms.md)."""
    warmup, steps, lr = 3, 30, 0.01
    n = hvd.size()
    w = nn.Parameter(torch.zeros(64))
    q = A.QAdamOptimizer([w], lr=lr, warmup_steps=warmup)
    opt = hvd.DistributedOptimizer(q, named_parameters=[("w", w)], algorithm=A.QAdamAlgorithm(q))
    twin = nn.Parameter(torch.zeros(64))
    adam = torch.optim.Adam([twin], lr=lr)
    for t in range(steps):
        before = w.detach().clone()
        opt.zero_grad()
        _revival_loss(w, hvd.rank(), t, warmup).backward()
        opt.step()
        assert torch.isfinite(w).all(), f"step {t + 1}: non-finite weights {w}"
        moved = (w.detach() - before).abs().max().item()
        if t >= warmup:  # (Adam's own steps may exceed lr a little)
            assert moved <= lr * (1 + 1e-5), f"step {t + 1}: a coordinate moved by {moved:.3g}"
        # Adam on the average of every rank's loss (the gradient full precision averaging gives).
        adam.zero_grad()
        (sum(_revival_loss(twin, r, t, warmup) for r in range(n)) / n).backward()
        adam.step()
        assert torch.isfinite(twin).all()
    # And QAdam still optimises: the curvature pulled the revived coordinates towards 0.
    assert w.detach()[1::2].abs().max() < 20 * lr


@pytest.mark.parametrize("hierarchical", [True, False])
def test_qadam_bits_do_not_depend_on_when_buckets_become_ready(hierarchical):
    """Same seed and data, once as fast as possible and once with rank-dependent pauses in the
    backward pass (the buckets, several per model here, become ready at other times and in
    other relative orders across ranks): the weights agree bit for bit (docs/algorithms.md,
    QAdam, "Reproducibility")."""
    import time

    def run(delays: bool):
        model = make_model(0)
        q = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        alg = A.QAdamAlgorithm(q, hierarchical=hierarchical)
        opt = hvd.DistributedOptimizer(q, named_parameters=model.named_parameters(), algorithm=alg)
        handles = []
        if delays:
            for i, p in enumerate(model.parameters()):
                pause = 0.004 * ((hvd.rank() + i) % 3)
                handles.append(p.register_hook(lambda g, s=pause: time.sleep(s)))
        _train(model, opt, steps=6)
        for h in handles:
            h.remove()
        return [p.detach().clone() for p in model.parameters()]

    fast, slow = run(False), run(True)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a, b), f"parameter {i} differs by {(a - b).abs().max():.3g}"


def test_new_low_precision_optimizer_after_one_dropped_mid_exchange():
    """An optimizer's last exchange runs on after step() returns; dropping the optimizer leaves
    it in flight under its bucket names. A new optimizer over the same parameters (same names)
    must still work on every rank: it waits for the leftover exchange first (a name stays taken
    until its handle is waited for, the same on every rank)."""
    if hvd.size() == 1:
        pytest.skip("one rank has no neighbours: nothing is exchanged")
    model = make_model(hvd.rank())
    for _ in range(3):
        opt = hvd.DistributedOptimizer(
            sgd(model.parameters()),
            named_parameters=model.named_parameters(),
            algorithm=A.LowPrecisionDecentralized(),
        )
        _train(model, opt, steps=2)
        del opt  # its second step's exchange may still be running
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_low_precision_ring_dropped_mid_exchange_is_released():
    """The core's ring of an implementation dropped with its exchanges in flight is released
    by a replan, or once the implementation is collected (the release waits for the
    exchanges), without a hang; a new ring under the same names then runs."""
    if hvd.size() == 1:
        pytest.skip("one rank has no neighbours: nothing is exchanged")
    model = make_model(hvd.rank())

    def trained():
        opt = hvd.DistributedOptimizer(
            sgd(model.parameters()),
            named_parameters=model.named_parameters(),
            algorithm=A.LowPrecisionDecentralized(),
        )
        _train(model, opt, steps=2)
        ring = opt._algo_impl.averaging
        assert lp_ring_pending(ring.ring) == len(ring.replicas)  # left in flight by step()
        return opt, ring.ring

    rings = []
    for _ in range(2):
        opt, ring = trained()
        rings.append(ring)
        opt._algo_impl.replan()  # as a reset does
        assert lp_ring_pending(ring) is None and opt._algo_impl.averaging.pending == []
        del opt
    assert rings[0] != rings[1]
    # Dropped without a replan: the finalizer releases it once the collector frees the ring.
    opt, ring = trained()
    del opt
    gc.collect()
    assert lp_ring_pending(ring) is None
    assert all(torch.isfinite(p).all() for p in model.parameters())


# Every algorithm, as a user picks it; the optimizer factory builds the local optimizer first
# (QAdam's algorithm wraps its own optimizer).
def _qadam(params):
    q = A.QAdamOptimizer(params, lr=0.01, warmup_steps=2)
    return q, A.QAdamAlgorithm(q)


STEPS_BEFORE_UNNAMED = 30  # past every warm-up; async: rounds while the ranks drift apart
EVERY_ALGORITHM = {
    "gradient_allreduce": lambda p: (sgd(p), A.GradientAllReduce()),
    "bytegrad": lambda p: (sgd(p), A.ByteGrad(error_feedback=True)),
    "qadam": _qadam,
    "decentralized": lambda p: (sgd(p), A.Decentralized(peer_selection_mode="shift_one")),
    "low_precision_decentralized": lambda p: (sgd(p), A.LowPrecisionDecentralized()),
    "async": lambda p: (sgd(p), A.AsyncModelAverage(sync_interval_ms=2, warmup_steps=2)),
}


@pytest.mark.parametrize("name", sorted(EVERY_ALGORITHM))
def test_unnamed_ops_after_training_with_rank_dependent_step_times(name):
    """A user's unnamed collectives after training match across ranks whatever the algorithm
    did in between: the background averaging rounds of AsyncModelAverage run a different number
    of times on each rank (rank r sleeps r ms per step), and once consumed the per-process
    counter behind "<op>.noname.<n>" (the ops then waited on different names forever)."""
    import time

    n, r = hvd.size(), hvd.rank()
    model = make_model(r)
    opt, alg = EVERY_ALGORITHM[name](model.parameters())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), algorithm=alg)
    impl = opt._algo_impl
    for step in range(STEPS_BEFORE_UNNAMED):
        opt.zero_grad()
        loss_fn(model, batches(r, step)).backward()
        opt.step()
        time.sleep(0.002 * r)
    if name == "async" and n > 1:

        def one_more_step() -> None:
            opt.zero_grad()
            loss_fn(model, batches(r, 0)).backward()
            opt.step()

        train_until_every_rank_averaged(
            hvd, impl.rounds, one_more_step, torch.tensor, lambda t: t.tolist()
        )
    # The averager keeps running while the user's ops go on, as in a training script.
    check_unnamed_ops(hvd, torch.tensor, lambda t: t.tolist())
    if name == "async":
        alg.abort()
    hvd.barrier()
