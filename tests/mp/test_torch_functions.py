"""Training helpers (broadcast_parameters, broadcast_optimizer_state, broadcast_object,
allgather_object) and SyncBatchNorm, run by every rank of a launched job (or alone at size 1).

References are plain torch, computed on every rank from every rank's regenerable inputs: the
root's model or optimizer is rebuilt locally from its seeds, and SyncBatchNorm is compared with
torch.nn.BatchNorm1d/2d/3d run on the concatenated batch. Run:
``bagua-run -np 3 python -m pytest -x -q tests/mp/test_torch_functions.py``.
"""

from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest
import torch

import bagua_hvd.torch as hvd


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


def root() -> int:
    """The root of the broadcasts: the last rank, so that it is not 0 when size() > 1."""
    return size() - 1


def gen(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


# ---- broadcast_parameters ---------------------------------------------------------------------
def make_model(seed: int) -> torch.nn.Module:
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    g = gen("model", seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
            else:
                t.fill_(seed + 7)  # num_batches_tracked (int64)
    return model


def assert_state_equal(got: dict, expected: dict, keys=None) -> None:
    for k in keys if keys is not None else expected:
        assert torch.equal(got[k], expected[k]), f"{k}: {got[k]} != {expected[k]}"


def test_broadcast_parameters_state_dict():
    model = make_model(rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=root())
    assert_state_equal(model.state_dict(), make_model(root()).state_dict())


def test_broadcast_parameters_named_and_plain_lists():
    model = make_model(rank())
    mine, ref = make_model(rank()).state_dict(), make_model(root()).state_dict()
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=root())
    params = {n for n, _ in model.named_parameters()}
    assert_state_equal(model.state_dict(), ref, params)
    # buffers were not in the list: still this rank's
    assert_state_equal(model.state_dict(), mine, set(mine) - params)

    model = make_model(rank())
    extra = torch.arange(12.0).reshape(3, 4).mul(rank() + 1).t()  # non-contiguous
    hvd.broadcast_parameters(list(model.parameters()) + [extra], root_rank=root())
    assert_state_equal(model.state_dict(), ref, params)
    assert torch.equal(extra, torch.arange(12.0).reshape(3, 4).mul(root() + 1).t())


def test_broadcast_parameters_invalid_type():
    model = make_model(0)
    with pytest.raises(ValueError) as e:
        hvd.broadcast_parameters(model.named_parameters(), 0)
    assert str(e.value) == "invalid params of type: <class 'generator'>"
    with pytest.raises(ValueError) as e:
        hvd.broadcast_parameters(tuple(model.parameters()), 0)
    assert str(e.value) == "invalid params of type: <class 'tuple'>"


# ---- broadcast_object / allgather_object ------------------------------------------------------
class Point:
    def __init__(self, x, tag):
        self.x, self.tag = x, tag

    def __eq__(self, other):
        return type(other) is Point and self.x == other.x and self.tag == other.tag


def make_object(r: int) -> dict:
    class Local:  # not importable: cloudpickle sends it by value
        def __init__(self, v):
            self.v = v

    return {
        "int": r,
        "float": r / 3,
        "str": f"rank-{r}",
        "none": None,
        "list": [r, [r + 1, (r + 2, "x")], {"deep": {r: [r] * r}}],
        "tuple": (r, True, 2.5),
        "set": {r, r + 10},
        "numpy": np.arange(6, dtype=np.float32).reshape(2, 3) * r,
        "tensor": torch.arange(5, dtype=torch.float64) * r,
        "custom": Point(r, ("p", r)),
        "local": Local(r * 11),
        "fn": lambda x: x + r,
        "blob": bytes([r % 256]) * (1000 * r + 17),  # a different length on every rank
    }


def assert_object_equal(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for k in ("int", "float", "str", "none", "list", "tuple", "set", "custom", "blob"):
        assert got[k] == expected[k], k
    np.testing.assert_array_equal(got["numpy"], expected["numpy"])
    assert got["numpy"].dtype == expected["numpy"].dtype
    assert torch.equal(got["tensor"], expected["tensor"])
    assert got["local"].v == expected["local"].v
    assert got["fn"](100) == expected["fn"](100)


def test_broadcast_object_nested():
    got = hvd.broadcast_object(make_object(rank()), root_rank=root())
    assert_object_equal(got, make_object(root()))
    # defaults: root_rank=0, name from the type; a named one on the global process set
    assert_object_equal(hvd.broadcast_object(make_object(rank())), make_object(0))
    got = hvd.broadcast_object(
        [rank()] * (rank() + 1), root(), name="bo.list", process_set=hvd.global_process_set
    )
    assert got == [root()] * (root() + 1)
    big = torch.randn(300_000, generator=gen("big", rank()))  # ~1.2 MB pickled
    assert torch.equal(
        hvd.broadcast_object(big, root()), torch.randn(300_000, generator=gen("big", root()))
    )


def test_allgather_object():
    got = hvd.allgather_object(make_object(rank()))
    assert isinstance(got, list) and len(got) == size()
    for r, obj in enumerate(got):
        assert_object_equal(obj, make_object(r))
    assert hvd.allgather_object(rank() * 2, name="ago.int") == [2 * r for r in range(size())]


# ---- broadcast_optimizer_state ----------------------------------------------------------------
def _options(name: str, r: int) -> dict:
    """Rank-specific options, so that param_groups differ before the broadcast."""
    lr = 0.01 * (r + 1)
    return {
        "SGD": dict(lr=lr, momentum=0.9 - 0.1 * r, nesterov=r % 2 == 0, dampening=0),
        "Adam": dict(lr=lr, betas=(0.9 - 0.01 * r, 0.99), amsgrad=True, weight_decay=0.01 * r),
        "AdamW": dict(lr=lr, betas=(0.8, 0.9 + 0.01 * r), weight_decay=0.1 + r),
        "Adagrad": dict(lr=lr, lr_decay=0.01 * r, initial_accumulator_value=0.1 * r),
        "RMSprop": dict(lr=lr, momentum=0.5, centered=True, alpha=0.9 + 0.01 * r),
        "Adadelta": dict(lr=1.0 + r, rho=0.8 + 0.01 * r),
        "Adamax": dict(lr=lr, betas=(0.7 + 0.01 * r, 0.99)),
        "NAdam": dict(lr=lr, momentum_decay=0.004 * (r + 1)),
        "RAdam": dict(lr=lr, betas=(0.9, 0.9 + 0.01 * r)),
        "ASGD": dict(lr=lr, lambd=1e-4 * (r + 1), t0=1.0),
        "Rprop": dict(lr=lr, etas=(0.5, 1.1 + 0.1 * r), step_sizes=(1e-6, 10 + r)),
        "Adafactor": dict(lr=lr, beta2_decay=-0.8 + 0.01 * r, eps=(None, 1e-3 * (r + 1))),
        "SparseAdam": dict(lr=lr, betas=(0.9, 0.9 + 0.01 * r)),
        "Muon": dict(lr=lr, momentum=0.9 - 0.01 * r),
    }[name]


OPTIMIZERS = [
    n
    for n in (
        "SGD",
        "Adam",
        "AdamW",
        "Adagrad",
        "RMSprop",
        "Adadelta",
        "Adamax",
        "NAdam",
        "RAdam",
        "ASGD",
        "Rprop",
        "Adafactor",
        "SparseAdam",
        "Muon",
    )
    if hasattr(torch.optim, n)
]


def make_training(name: str, r: int, steps: int):
    """Rank r's model and optimizer after ``steps`` steps on rank-specific gradients.

    Plain torch; the test rebuilds the root's copy with it as the reference."""
    g = gen("opt", name, r)
    if name == "SparseAdam":
        model = torch.nn.Embedding(6, 3, sparse=True)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        model[0].bias.requires_grad_(False)  # a frozen parameter: no state anywhere
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    opts = _options(name, r)
    if name in ("SparseAdam", "Muon"):
        params = [p for p in model.parameters() if p.dim() == 2]
        opt = getattr(torch.optim, name)(params, **opts)
    else:
        second = dict(opts, lr=opts["lr"] * 0.5)
        second["params"] = list(model[2].parameters())
        opt = getattr(torch.optim, name)([{"params": list(model[0].parameters())}, second], **opts)
    for _ in range(steps):
        for group in opt.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                grad = torch.randn(p.shape, generator=g)
                if name == "SparseAdam":
                    grad[torch.arange(p.shape[0]) % 2 == 1] = 0
                    grad = grad.to_sparse()
                p.grad = grad
        opt.step()
    return model, opt


def assert_optimizer_equal(opt, ref) -> None:
    params = [p for group in opt.param_groups for p in group["params"]]
    ref_params = [p for group in ref.param_groups for p in group["params"]]
    assert len(params) == len(ref_params)
    for g, rg in zip(opt.param_groups, ref.param_groups):
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in rg.items() if k != "params"
        }
    for i, (p, rp) in enumerate(zip(params, ref_params)):
        st, rst = opt.state.get(p, {}), ref.state.get(rp, {})
        assert list(st) == list(rst), (i, list(st), list(rst))
        for k, v in rst.items():
            if torch.is_tensor(v):
                assert torch.is_tensor(st[k]) and st[k].dtype == v.dtype, (i, k)
                assert torch.equal(st[k], v), (i, k, st[k], v)
            else:
                assert st[k] == v and type(st[k]) is type(v), (i, k, st[k], v)


def params_of(model) -> list:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["trained", "fresh_peers", "fresh"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_broadcast_optimizer_state(name, mode):
    """trained: every rank has its own state (rank + 1 steps) and options; fresh_peers: only the
    root has trained; fresh: nobody has (the state is initialised by a step on zero grads)."""

    def steps(r):
        return {"trained": r + 1, "fresh_peers": 2 if r == root() else 0, "fresh": 0}[mode]

    model, opt = make_training(name, rank(), steps(rank()))
    before = params_of(model)
    grads_before = [p.grad for p in model.parameters()]
    initialised = len(opt.state) == 0
    hvd.broadcast_optimizer_state(opt, root_rank=root(), model=model if mode != "fresh" else None)

    ref_model, ref = make_training(name, root(), steps(root()))
    if len(ref.state) == 0:  # the reference of Horovod's initialisation: one step on zeros
        for group in ref.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
                    if name == "SparseAdam":
                        p.grad = p.grad.to_sparse()
        ref.step()
    assert len(ref.state) > 0
    assert_optimizer_equal(opt, ref)
    # the parameters are untouched (also by the initialising step)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)
    # Horovod: a rank that initialised its state leaves a zero gradient on every parameter of
    # the optimizer that requires grad (sparse for SparseAdam); other gradients are untouched.
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    for p, gb in zip(model.parameters(), grads_before):
        if initialised and p.requires_grad and id(p) in in_opt:
            assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype
            assert p.grad.is_sparse == (name == "SparseAdam"), p.grad.layout
            assert not p.grad.to_dense().any(), p.grad
        else:
            assert p.grad is gb
    if name != "SparseAdam":  # one more step: every rank now does the same update to the state
        for p in model.parameters():
            p.grad = torch.ones_like(p) if p.requires_grad else None
        opt.step()


def test_broadcast_optimizer_state_lbfgs():
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError) as e:
        hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), 0)
    assert str(e.value) == "cannot broadcast torch.optim.LBFGS state"


def test_broadcast_optimizer_state_stateless_sgd_options():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank() + 1), weight_decay=rank())
    before = params_of(model)
    hvd.broadcast_optimizer_state(opt, root())
    assert opt.param_groups[0]["lr"] == 0.1 * (root() + 1)
    assert opt.param_groups[0]["weight_decay"] == root()
    assert len(opt.state) == 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(p.grad, torch.zeros(p.shape)) for p in model.parameters())


def test_broadcast_optimizer_state_sparse_embedding_sgd():
    """Horovod: with ``model``, SGD's zero gradients of a sparse Embedding are sparse; a frozen
    parameter keeps its None."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3, sparse=True), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root(), model=model)
    emb, weight, bias = model[0].weight, model[1].weight, model[1].bias
    assert emb.grad.is_sparse and not emb.grad.to_dense().any()
    assert not weight.grad.is_sparse and torch.equal(weight.grad, torch.zeros(2, 3))
    assert bias.grad is None


def test_broadcast_optimizer_state_layout_differs_from_root():
    """A peer whose state lacks an entry the root has (and has one the root lacks) ends up
    with exactly the root's state."""
    model, opt = make_training("Adam", rank(), 2)
    params = [p for group in opt.param_groups for p in group["params"]]
    if rank() != root():
        del opt.state[params[0]]["exp_avg_sq"]
        opt.state[params[0]]["extra"] = torch.zeros(3)
        opt.state[params[-1]]["step"] = 5.0  # a float where the root has a tensor
    hvd.broadcast_optimizer_state(opt, root())
    _, ref = make_training("Adam", root(), 2)
    assert_optimizer_equal(opt, ref)


def test_broadcast_optimizer_state_mismatched_models_raise_everywhere():
    if size() == 1:
        pytest.skip("needs peers")
    width = 4 if rank() == 0 else 5
    opt = torch.optim.SGD(torch.nn.Linear(3, width).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="parameters differ between ranks"):
        hvd.broadcast_optimizer_state(opt, root())


@pytest.mark.skipif(not hasattr(hvd, "DistributedOptimizer"), reason="no DistributedOptimizer")
def test_broadcast_optimizer_state_distributed_optimizer():
    """Root trained, peers fresh, all wrapped: the peers' initialising step must not talk."""
    model, plain = make_training("SGD", rank(), 2 if rank() == root() else 0)
    opt = hvd.DistributedOptimizer(plain, named_parameters=model.named_parameters())
    if rank() == root():
        opt.load_state_dict(plain.state_dict())
    before = params_of(model)
    hvd.broadcast_optimizer_state(opt, root_rank=root(), model=model)
    _, ref = make_training("SGD", root(), 2)
    assert_optimizer_equal(opt, ref)
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before))


# ---- SyncBatchNorm ----------------------------------------------------------------------------
BN = {
    2: torch.nn.BatchNorm1d,
    3: torch.nn.BatchNorm1d,
    4: torch.nn.BatchNorm2d,
    5: torch.nn.BatchNorm3d,
}
C = 3


def batch_of(case, it: int, r: int, tail: tuple, dtype) -> tuple:
    """Rank r's input (uneven batch sizes: 2 + r rows; offset mean) and output gradient."""
    g = gen("sbn", case, it, r)
    shape = (2 + r, C) + tail
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 5).to(dtype)
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return x, dy


SBN_CASES = [
    # (tail, dtype, momentum, affine, track_running_stats)
    ((), torch.float64, 0.1, True, True),
    ((5,), torch.float64, 0.1, True, True),
    ((3, 4), torch.float64, 0.1, True, True),
    ((2, 3, 2), torch.float64, 0.1, True, True),
    ((3, 4), torch.float64, None, True, True),
    ((3, 4), torch.float64, 0.3, False, True),
    ((3, 4), torch.float64, 0.1, True, False),
    ((3, 4), torch.float32, 0.1, True, True),
]


@pytest.mark.parametrize(
    "case", SBN_CASES, ids=lambda c: f"{len(c[0]) + 2}d-{c[1]}-{c[2]}-{c[3]}-{c[4]}"
)
def test_sync_batch_norm_matches_batch_norm_on_concatenated_batch(case):
    tail, dtype, momentum, affine, track = case
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    sbn = hvd.SyncBatchNorm(C, momentum=momentum, affine=affine, track_running_stats=track)
    ref = BN[len(tail) + 2](C, momentum=momentum, affine=affine, track_running_stats=track)
    sbn, ref = sbn.to(dtype), ref.to(dtype)
    assert isinstance(sbn, torch.nn.modules.batchnorm._BatchNorm)
    if affine:
        weight = torch.rand(C, generator=gen("w", case), dtype=torch.float64) + 0.5
        bias = torch.randn(C, generator=gen("b", case), dtype=torch.float64)
        with torch.no_grad():
            for m in (sbn, ref):
                m.weight.copy_(weight)
                m.bias.copy_(bias)
    starts = np.cumsum([0] + [2 + r for r in range(size())])
    mine = slice(int(starts[rank()]), int(starts[rank() + 1]))

    for it in range(3):
        batches = [batch_of(case, it, r, tail, dtype) for r in range(size())]
        x = batches[rank()][0].clone().requires_grad_()
        out = sbn(x)
        (out * batches[rank()][1]).sum().backward()

        xs = torch.cat([b[0] for b in batches]).requires_grad_()
        ref_out = ref(xs)
        (ref_out * torch.cat([b[1] for b in batches])).sum().backward()

        assert out.dtype == dtype and out.shape == x.shape
        torch.testing.assert_close(out, ref_out[mine], **tol)
        torch.testing.assert_close(x.grad, xs.grad[mine], **tol)
        if affine:  # local shares; their sum is the gradient of the global batch
            for p, rp in ((sbn.weight, ref.weight), (sbn.bias, ref.bias)):
                total = hvd.allreduce(p.grad, op=hvd.Sum, name=f"sbn.test.grad.{it}")
                torch.testing.assert_close(total, rp.grad, **tol)
                p.grad = None
                rp.grad = None
        if track:
            torch.testing.assert_close(sbn.running_mean, ref.running_mean, **tol)
            torch.testing.assert_close(sbn.running_var, ref.running_var, **tol)
            assert int(sbn.num_batches_tracked) == int(ref.num_batches_tracked) == it + 1

    # eval mode: running statistics (or, without them, the global batch's statistics)
    sbn.eval()
    ref.eval()
    batches = [batch_of(case, 10, r, tail, dtype) for r in range(size())]
    with torch.no_grad():
        out = sbn(batches[rank()][0])
        ref_out = ref(torch.cat([b[0] for b in batches]))
    torch.testing.assert_close(out, ref_out[mine], **tol)


def test_sync_batch_norm_checks_and_convert():
    sbn = hvd.SyncBatchNorm(4)
    assert (sbn.eps, sbn.momentum, sbn.affine, sbn.track_running_stats) == (1e-5, 0.1, True, True)
    with pytest.raises(ValueError) as e:
        sbn(torch.randn(4))
    assert str(e.value) == "expected at least 2D input (got 1D input)"

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 4),
        torch.nn.BatchNorm1d(4, momentum=0.2),
        torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4, affine=False)),
    )
    model[1].running_mean.fill_(1.5)
    weight = model[1].weight
    converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(converted[1]) is hvd.SyncBatchNorm and type(converted[2][1]) is hvd.SyncBatchNorm
    assert converted[1].weight is weight and converted[1].momentum == 0.2
    assert torch.equal(converted[1].running_mean, torch.full((4,), 1.5))
    assert converted[2][1].weight is None and not converted[2][1].affine
    assert type(converted[0]) is torch.nn.Linear


def test_broadcast_optimizer_state_tensor_options():
    """Tensor-valued options (lr as a tensor) are broadcast in place; tuples stay tuples."""
    model = torch.nn.Linear(3, 2)
    lr = torch.tensor(0.01 * (rank() + 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.99 - 0.01 * rank()))
    hvd.broadcast_optimizer_state(opt, root())
    assert opt.param_groups[0]["lr"] is lr
    assert torch.equal(lr, torch.tensor(0.01 * (root() + 1)))
    assert opt.param_groups[0]["betas"] == (0.9, 0.99 - 0.01 * root())


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
        lambda ps: torch.optim.AdamW(ps, lr=0.01),
        lambda ps: torch.optim.ASGD(ps, lr=0.01),
    ],
)
def test_state_initialisation_in_chunks_matches_one_step(make, monkeypatch):
    """The empty state is initialised in chunks of parameters (to bound the transient memory):
    the result must equal plain torch's one step() on zero gradients, parameters untouched, zero
    gradients left."""
    from bagua_hvd.torch import functions

    monkeypatch.setattr(functions, "_INIT_CHUNK_BYTES", 1)  # one parameter per chunk
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    reference = copy.deepcopy(model)
    opt = make([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.5}])
    ref = make(
        [{"params": reference[0].parameters()}, {"params": reference[2].parameters(), "lr": 0.5}]
    )
    before = [p.detach().clone() for p in model.parameters()]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for p in reference.parameters():
        p.grad = torch.zeros_like(p)
    ref.step()  # plain torch: what Horovod's initialisation does (parameters may move)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and torch.equal(p.grad, torch.zeros_like(p))  # Horovod's zeros
    for p, q in zip(model.parameters(), reference.parameters()):
        mine, theirs = opt.state[p], ref.state[q]
        assert mine.keys() == theirs.keys()
        for k in mine:
            if torch.is_tensor(theirs[k]):
                assert torch.equal(mine[k], theirs[k]), k
            else:
                assert mine[k] == theirs[k], k
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    assert all(len(g["params"]) == 2 for g in opt.param_groups)
