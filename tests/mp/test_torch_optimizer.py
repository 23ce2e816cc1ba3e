"""hvd.DistributedOptimizer, run by every rank of a launched job (or alone at size 1).

Results are checked against tests/reference_training.py: plain torch, one process, training a
copy of the same model on the concatenation of every rank's batches. Weights must agree within
1e-5 relative (max |got - want| <= 1e-5 * max |want|, per tensor) in float64 and float32;
with Compression.fp16 within 2e-3 and with Compression.bf16 within 2e-2 (their epsilons, 2^-10
and 2^-7, times a few steps of rounding).

At size 1 the fixture sets HOROVOD_ELASTIC=1, which makes the optimizer register its hooks and
communicate as it does with more ranks (Horovod's rule), so every path runs at every size.
"""

from __future__ import annotations

import copy
import gc
import re
import warnings
import weakref

import pytest
import reference_training as ref
import torch

import bagua_hvd.torch as hvd
from bagua_hvd.torch.compression import Compressor

STEPS = 4  # the first step runs with the first-guess buckets, the others with flat buffers


@pytest.fixture(autouse=True)
def _hooks_at_every_size(monkeypatch):
    if hvd.size() == 1:
        monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    monkeypatch.delenv("BAGUA_HVD_BUCKET_MB", raising=False)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


def _plain_sgd(params):
    return torch.optim.SGD(params, lr=0.1)


OPTIMIZERS = {"sgd_momentum": _sgd, "adam": _adam}


def _assert_close(got: torch.nn.Module, want: torch.nn.Module, rtol: float, what: str) -> None:
    for (name, a), (_, b) in zip(got.named_parameters(), want.named_parameters()):
        scale = b.detach().abs().max().item()
        err = (a.detach() - b.detach()).abs().max().item()
        assert err <= rtol * scale, f"{what}: {name} differs by {err:.3g} (scale {scale:.3g})"


def _distributed(model, make_opt, seed, steps=STEPS, micro=1, clip=None, step_hook=None, **kwargs):
    """Trains ``model`` on this rank's batches through DistributedOptimizer; returns it."""
    dtype = next(model.parameters()).dtype
    opt = hvd.DistributedOptimizer(
        make_opt(model.parameters()), named_parameters=model.named_parameters(), **kwargs
    )
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            b = ref.batch(seed, step, hvd.rank(), m, dtype=dtype)
            (ref.loss_of(model, b) / micro).backward()
        if clip is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if step_hook is not None:
            step_hook(opt, step)
    return opt


def _model_pair(seed, dtype=torch.float64, **kwargs):
    return ref.make_model(seed, dtype, **kwargs), ref.make_model(seed, dtype, **kwargs)


# ---- construction ---------------------------------------------------------------------------
def test_returns_instance_of_wrapped_class_with_same_name():
    model = ref.make_model(1)
    for make in (_sgd, _adam, lambda p: torch.optim.RMSprop(p, lr=0.01)):
        base = make(model.parameters())
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        assert isinstance(opt, type(base))
        assert type(opt) is not type(base)
        assert type(opt).__name__ == type(base).__name__
        assert opt.param_groups[0]["params"] == base.param_groups[0]["params"]
        assert opt.param_groups[0]["lr"] == base.param_groups[0]["lr"]


def test_step_and_step_hooks_run_once():
    model = ref.make_model(11)
    opt = hvd.DistributedOptimizer(_plain_sgd(model.parameters()))
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)  # the same everywhere: the average is ones
    opt.step()
    assert calls == ["pre", "post"]
    for b, p in zip(before, model.parameters()):
        torch.testing.assert_close(p.detach(), b - 0.1)


def test_parameter_names():
    model = ref.make_model(2)
    groups = [
        {"params": [model.fc1.weight, model.fc1.bias]},
        {"params": [model.fc2.weight, model.fc2.bias, model.fc3.weight, model.fc3.bias]},
    ]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups, lr=0.1))
    expected = {
        p: f"allreduce.noname.{i}.{j}"
        for i, g in enumerate(groups)
        for j, p in enumerate(g["params"])
    }
    assert opt._parameter_names == expected
    named = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    assert named._parameter_names == {p: n for n, p in model.named_parameters()}


def _messages_cases(model):
    params = list(model.parameters())
    named = list(model.named_parameters())
    return [
        (
            dict(named_parameters=[list(t) for t in named]),
            ValueError,
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters().",
        ),
        (
            dict(named_parameters=[("a", params[0]), ("a", params[1])] + named[2:]),
            ValueError,
            "Parameter names in named_parameters must be unique. Found duplicates: a",
        ),
        (
            dict(named_parameters=named[1:]),
            ValueError,
            "named_parameters was specified, but one or more model parameters were not named. "
            f"Python object ids: {id(params[0])}",
        ),
        (dict(backward_passes_per_step=0), ValueError, "backward_passes_per_step must be > 0"),
        (dict(backward_passes_per_step=-1), ValueError, "backward_passes_per_step must be > 0"),
        (
            dict(gradient_predivide_factor=2.0, op=hvd.Sum),
            ValueError,
            "gradient_predivide_factor not supported with op != Average",
        ),
        (
            dict(groups=-1),
            ValueError,
            "groups should be a non-negative integer or a list of list of torch.Tensor.",
        ),
        (
            dict(groups=0),
            ValueError,
            "groups should be a non-negative integer or a list of list of torch.Tensor.",
        ),
        (dict(groups=[[params[0], 3]]), ValueError, "groups must consist of torch.Tensor."),
        (
            dict(groups=[[params[0]], [params[1], params[0]]]),
            ValueError,
            "A parameter can only appear once in groups.",
        ),
    ]


def test_validation_messages():
    model = ref.make_model(3)
    for kwargs, exc, message in _messages_cases(model):
        with pytest.raises(exc) as info:
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        assert str(info.value) == message, kwargs


def test_num_groups_is_deprecated_for_groups():
    model = ref.make_model(4)
    with pytest.warns(DeprecationWarning) as record:
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            num_groups=2,
        )
    assert str(record[0].message) == (
        "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0."
    )
    assert opt._groups == 2


# ---- equivalence with one process on the concatenated batches -------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("bucket_mb", ["default", "0.0005", "0"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_equivalence(opt_name, bucket_mb, dtype, monkeypatch):
    if bucket_mb != "default":  # 0.0005 MiB: several buckets; 0: one per parameter
        monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", bucket_mb)
    seed = ref.seed_for("equivalence", opt_name, bucket_mb, str(dtype))
    mine, reference = _model_pair(seed, dtype)
    opt = _distributed(mine, OPTIMIZERS[opt_name], seed)
    ref.train(reference, OPTIMIZERS[opt_name], seed, STEPS, hvd.size())
    _assert_close(mine, reference, 1e-5, f"{opt_name} bucket_mb={bucket_mb}")
    if bucket_mb == "0.0005":
        assert len(opt._buckets) > 1
    if bucket_mb == "0":
        assert len(opt._buckets) == len(list(mine.parameters()))


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_backward_passes_per_step(opt_name, monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("bpps", opt_name)
    mine, reference = _model_pair(seed)
    _distributed(mine, OPTIMIZERS[opt_name], seed, micro=2, backward_passes_per_step=2)
    ref.train(reference, OPTIMIZERS[opt_name], seed, STEPS, hvd.size(), micro_batches=2)
    _assert_close(mine, reference, 1e-5, opt_name)


def test_set_backward_passes_per_step():
    seed = ref.seed_for("set_bpps")
    mine, reference = _model_pair(seed)

    def switch(opt, step):
        assert opt.backward_passes_per_step == 1
        opt.set_backward_passes_per_step(3)
        assert set(opt._allreduce_delay.values()) == {3}

    dtype = torch.float64
    opt = hvd.DistributedOptimizer(
        _sgd(mine.parameters()), named_parameters=mine.named_parameters()
    )
    for step in range(2):  # one step with 1 pass, then two with 3
        opt.zero_grad()
        ref.loss_of(mine, ref.batch(seed, step, hvd.rank(), 0, dtype=dtype)).backward()
        opt.step()
    switch(opt, 1)
    for step in range(2, 4):
        opt.zero_grad()
        for m in range(3):
            b = ref.batch(seed, step, hvd.rank(), m, dtype=dtype)
            (ref.loss_of(mine, b) / 3).backward()
        opt.step()
    # Reference: two steps on single batches, then two on three micro-batches each.
    ref_opt = _sgd(list(reference.parameters()))
    for step in range(4):
        micro = 1 if step < 2 else 3
        everything = [
            ref.batch(seed, step, r, m, dtype=dtype)
            for r in range(hvd.size())
            for m in range(micro)
        ]
        ref_opt.zero_grad()
        ref.loss_of(reference, ref.concat(everything)).backward()
        ref_opt.step()
    _assert_close(mine, reference, 1e-5, "set_backward_passes_per_step")


@pytest.mark.parametrize("op", ["average_predivide", "sum"])
def test_reduce_op_and_predivide(op):
    seed = ref.seed_for("op", op)
    mine, reference = _model_pair(seed)
    if op == "sum":  # summed gradients: plain SGD with size() times the learning rate
        _distributed(mine, _plain_sgd, seed, op=hvd.Sum)
        ref.train(
            reference, lambda p: torch.optim.SGD(p, lr=0.1 * hvd.size()), seed, STEPS, hvd.size()
        )
    else:
        _distributed(mine, _sgd, seed, gradient_predivide_factor=4.0)
        ref.train(reference, _sgd, seed, STEPS, hvd.size())
    _assert_close(mine, reference, 1e-5, op)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_compression(kind, monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    compression = getattr(hvd.Compression, kind)
    low = torch.float16 if kind == "fp16" else torch.bfloat16
    tol = 2e-3 if kind == "fp16" else 2e-2
    seed = ref.seed_for("compression", kind)
    mine, reference = _model_pair(seed, torch.float32)

    def check_rounded(opt, step):
        # The averaged gradients went through the low-precision type.
        for p in mine.parameters():
            assert p.grad.dtype == torch.float32
            assert torch.equal(p.grad, p.grad.to(low).float()), f"step {step}: not {kind}"

    opt = hvd.DistributedOptimizer(
        _plain_sgd(mine.parameters()),
        named_parameters=mine.named_parameters(),
        compression=compression,
    )
    for step in range(STEPS):
        opt.zero_grad()
        ref.loss_of(mine, ref.batch(seed, step, hvd.rank(), dtype=torch.float32)).backward()
        opt.synchronize()
        check_rounded(opt, step)
        with opt.skip_synchronize():
            opt.step()
    ref.train(reference, _plain_sgd, seed, STEPS, hvd.size())
    _assert_close(mine, reference, tol, kind)


class _HalfCompressor(Compressor):
    """A user-defined compressor (per-tensor semantics: the optimizer must call it per grad)."""

    calls = 0

    @staticmethod
    def compress(tensor):
        _HalfCompressor.calls += 1
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


def test_custom_compressor_is_called_per_gradient():
    seed = ref.seed_for("custom_compressor")
    mine, reference = _model_pair(seed, torch.float32)
    _HalfCompressor.calls = 0
    _distributed(mine, _plain_sgd, seed, compression=_HalfCompressor)
    ref.train(reference, _plain_sgd, seed, STEPS, hvd.size())
    assert _HalfCompressor.calls == STEPS * len(list(mine.parameters()))
    _assert_close(mine, reference, 2e-3, "custom compressor")


# ---- synchronize / step / zero_grad ---------------------------------------------------------
def test_skip_synchronize_with_gradient_clipping():
    seed = ref.seed_for("clip")
    mine, reference = _model_pair(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step() called without skip_synchronize" warning
        _distributed(mine, _sgd, seed, clip=0.05)
    ref.train(reference, _sgd, seed, STEPS, hvd.size(), clip=0.05)
    _assert_close(mine, reference, 1e-5, "clipped")


def test_step_after_synchronize_warns():
    seed = ref.seed_for("warn")
    model = ref.make_model(seed)
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    opt.zero_grad()
    ref.loss_of(model, ref.batch(seed, 0, hvd.rank())).backward()
    opt.synchronize()
    message = (
        "optimizer.step() called without optimizer.skip_synchronize() context after "
        "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
        "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
        "code."
    )
    with pytest.warns(UserWarning, match=re.escape(message)) as record:
        opt.step()
    assert [str(w.message) for w in record] == [message]
    # The next step, without synchronize(), does not warn.
    opt.zero_grad()
    ref.loss_of(model, ref.batch(seed, 1, hvd.rank())).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


ZERO_GRAD_MESSAGE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)


@pytest.mark.parametrize("passes", [1, 2])
def test_zero_grad_between_backward_and_step_raises(passes):
    seed = ref.seed_for("zero_grad", passes)
    model = ref.make_model(seed)
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=passes,
    )
    for step in range(2):  # first-guess buckets, then flat buffers
        opt.zero_grad()
        ref.loss_of(model, ref.batch(seed, step, hvd.rank())).backward()
        with pytest.raises(AssertionError) as info:
            opt.zero_grad()
        assert str(info.value) == ZERO_GRAD_MESSAGE
        opt.step()  # synchronize() sends what has not been sent yet
    opt.zero_grad()  # allowed again


def test_too_many_backward_passes_raise():
    seed = ref.seed_for("too_many")
    model = ref.make_model(seed)
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    for step in range(2):
        opt.zero_grad()
        ref.loss_of(model, ref.batch(seed, step, hvd.rank())).backward()
        with pytest.raises(AssertionError) as info:
            ref.loss_of(model, ref.batch(seed, step, hvd.rank(), 1)).backward()
        assert str(info.value) == (
            "Gradients were computed more than backward_passes_per_step times before call to "
            "step(). Increase backward_passes_per_step to accumulate gradients locally."
        )
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("algorithm", [None, "bytegrad"])
def test_hooks_go_away_with_the_optimizer(algorithm):
    """The gradient hooks must not keep their optimizer alive (on Horovod's path the hook is the
    buckets' own method), and once it is collected, backward no longer reduces anything."""
    seed = ref.seed_for("hooks_go_away")
    f32 = torch.float32  # ByteGrad compresses float32
    model = ref.make_model(seed, f32)
    kwargs = {}
    if algorithm is not None:
        from bagua_hvd.torch.algorithms import ByteGrad

        kwargs["algorithm"] = ByteGrad()
    opt = hvd.DistributedOptimizer(
        _plain_sgd(model.parameters()), named_parameters=model.named_parameters(), **kwargs
    )
    opt.zero_grad()
    ref.loss_of(model, ref.batch(seed, 0, hvd.rank(), dtype=f32)).backward()
    opt.step()
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None, "the optimizer outlived its last reference"
    local = copy.deepcopy(model)
    for m in (model, local):
        m.zero_grad()
        ref.loss_of(m, ref.batch(seed, 1, hvd.rank(), dtype=f32)).backward()
    for (name, a), (_, b) in zip(model.named_parameters(), local.named_parameters()):
        assert torch.equal(a.grad, b.grad), f"{name}: reduced after its optimizer went away"


def test_load_state_dict_resets_handles():
    seed = ref.seed_for("load_state_dict")
    model = ref.make_model(seed)
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    for step in range(2):
        opt.zero_grad()
        ref.loss_of(model, ref.batch(seed, step, hvd.rank())).backward()
        assert opt._handles
        pending = [h for h in opt._handles.values() if h.started]
        opt.load_state_dict(opt.state_dict())
        assert not opt._handles
        opt.zero_grad()  # no pending handles any more
        for h in pending:  # let the dropped operations finish before the next step
            h.wait()


# ---- unused parameters, groups, sparse gradients ----------------------------------------------
def test_unused_parameters_are_reduced(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("unused")
    model = ref.make_model(seed, extras=True)
    reference = ref.make_model(seed, extras=True)

    def uses_extra(rank):
        return rank % 2 == 0

    want = ref.extra_grad(reference, seed, hvd.size(), uses_extra)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters()
    )
    for _ in range(3):  # lr 0: the same gradients every step, through both bucket forms
        opt.zero_grad()
        b = ref.batch(seed, 0, hvd.rank())
        ref.loss_of(model, b, use_extra=uses_extra(hvd.rank())).backward()
        if not uses_extra(hvd.rank()):
            assert model.extra.grad is None
        assert model.never.grad is None
        opt.synchronize()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12, msg=name)
        assert torch.count_nonzero(model.never.grad) == 0
        with opt.skip_synchronize():
            opt.step()


@pytest.mark.parametrize("groups", ["int", "list"])
def test_groups(groups):
    seed = ref.seed_for("groups", groups)
    mine, reference = _model_pair(seed)
    if groups == "int":
        spec = 2
        expected = 2
    else:
        spec = [[mine.fc1.weight, mine.fc3.bias], [mine.fc2.weight]]
        expected = 2 + (len(list(mine.parameters())) - 3)  # the rest are groups of their own
    opt = _distributed(mine, _adam, seed, groups=spec)
    ref.train(reference, _adam, seed, STEPS, hvd.size())
    _assert_close(mine, reference, 1e-5, f"groups={groups}")
    assert len(opt._buckets) == expected
    if groups == "list":
        members = [set(map(id, b.params)) for b in opt._buckets]
        assert {id(mine.fc1.weight), id(mine.fc3.bias)} in members
        assert {id(mine.fc2.weight)} in members


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(sparse_as_dense, monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("sparse", sparse_as_dense)
    mine, reference = _model_pair(seed, embedding="sparse")

    def check(opt, step):
        assert mine.emb.weight.grad.is_sparse
        if not sparse_as_dense and step > 0:
            assert mine.emb.weight in opt._bucketing.sparse
            assert mine.emb.weight not in opt._bucketing.by_param

    _distributed(mine, _plain_sgd, seed, sparse_as_dense=sparse_as_dense, step_hook=check)
    ref.train(reference, _plain_sgd, seed, STEPS, hvd.size())
    _assert_close(mine, reference, 1e-5, f"sparse_as_dense={sparse_as_dense}")


# ---- buckets --------------------------------------------------------------------------------
def test_gradients_are_views_of_bucket_buffers(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("views")
    model = ref.make_model(seed, torch.float32)
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    for step in range(3):
        opt.zero_grad(set_to_none=step != 2)
        ref.loss_of(model, ref.batch(seed, step, hvd.rank(), dtype=torch.float32)).backward()
        opt.step()
        if step == 0:
            continue
        # Every gradient of a bucket of several lives in the bucket's flat buffer, so the core
        # reduces the buffer in place and keeps no copy; a bucket of one parameter (bigger
        # than the cap) is reduced in the parameter's own .grad.
        assert any(len(b.params) > 1 for b in opt._buckets)
        assert any(len(b.params) == 1 for b in opt._buckets)
        for b in opt._buckets:
            if len(b.params) == 1:
                assert b.direct and b.flat is None
                continue
            start = b.flat.data_ptr()
            end = start + b.flat.numel() * b.flat.element_size()
            for p in b.params:
                assert start <= p.grad.data_ptr() < end
    # Buckets follow the order gradients became ready: the last layer's first.
    first = opt._buckets[0].params
    assert any(p is model.fc3.weight or p is model.fc3.bias for p in first)


def test_buckets_are_not_fused_by_the_core(monkeypatch):
    # Two buckets of one 1 MiB layer each: the core must reduce each in place (tensors of
    # BAGUA_HVD_NO_FUSE_BYTES = 1 MiB or more are never copied into its fusion buffer).
    from bagua_hvd.common import ops

    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "1.2")  # one 512x512 layer (+ bias) per bucket
    torch.manual_seed(7)

    def net():
        return torch.nn.Sequential(
            torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512)
        )

    model, reference = net(), net()
    reference.load_state_dict(model.state_dict())
    opt = hvd.DistributedOptimizer(
        _sgd(model.parameters()), named_parameters=model.named_parameters()
    )
    ref_opt = _sgd(reference.parameters())
    lib = ops.native().lib
    fused_before = lib.bhvd_stat(b"fused_tensors")  # the twin's allreduces are synchronous
    for step in range(STEPS):
        xs = [
            torch.randn(8, 512, generator=torch.Generator().manual_seed(step * 10 + r))
            for r in range(hvd.size())
        ]
        twin = copy.deepcopy(model)
        opt.zero_grad()
        model(xs[hvd.rank()]).pow(2).mean().backward()
        opt.synchronize()
        # A plain Average allreduce of each local gradient (the ring splits a bucket and a lone
        # gradient into different segments, so at 3+ ranks the sums may differ in the last bit).
        twin(xs[hvd.rank()]).pow(2).mean().backward()
        for (name, p), t in zip(model.named_parameters(), twin.parameters()):
            want = hvd.allreduce(t.grad, op=hvd.Average, name=f"twin.{name}")
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-9, msg=name)
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        reference(torch.cat(xs)).pow(2).mean().backward()
        ref_opt.step()
    assert len(opt._buckets) == 2
    assert lib.bhvd_stat(b"fused_tensors") == fused_before
    _assert_close(model, reference, 1e-5, "two buckets")


class _Reordered(torch.nn.Module):
    """Layers registered in the opposite order of their use: the first guess (reverse
    registration order) is wrong, and the buckets are rebuilt after the first step."""

    def __init__(self):
        super().__init__()
        self.last = torch.nn.Linear(16, 3)
        self.first = torch.nn.Linear(12, 16)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


def test_buckets_follow_the_observed_order(monkeypatch):
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0003")  # 314 bytes: several buckets
    torch.manual_seed(3)
    model = _Reordered().double()
    reference = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(
        _adam(model.parameters()), named_parameters=model.named_parameters()
    )
    ref_opt = _adam(list(reference.parameters()))
    guess = [[id(p) for p in b.params] for b in opt._buckets]
    assert opt._buckets[0].params[0] is model.first.bias  # reverse registration order
    seed = ref.seed_for("reordered")
    for step in range(STEPS):
        batches = [ref.batch(seed, step, r) for r in range(hvd.size())]
        opt.zero_grad()
        b = batches[hvd.rank()]
        ((model(b["x"]) - b["y"]) ** 2).mean().backward()
        opt.step()
        whole = ref.concat(batches)
        ref_opt.zero_grad()
        ((reference(whole["x"]) - whole["y"]) ** 2).mean().backward()
        ref_opt.step()
        if step == 0:
            rebuilt = [[id(p) for p in b.params] for b in opt._buckets]
            assert rebuilt != guess
            assert opt._buckets[0].params[0] in (model.last.bias, model.last.weight)
    _assert_close(model, reference, 1e-5, "rebuilt buckets")


# ---- the update bucket by bucket --------------------------------------------------------------
BUCKETWISE = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": _sgd,
    "sgd_nesterov_wd_foreach": lambda p: torch.optim.SGD(
        p, lr=0.05, momentum=0.8, nesterov=True, weight_decay=1e-3, foreach=True
    ),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": _adam,
    "adam_amsgrad_foreach": lambda p: torch.optim.Adam(
        p, lr=0.01, amsgrad=True, weight_decay=1e-2, foreach=True
    ),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw_foreach_maximize": lambda p: torch.optim.AdamW(p, lr=0.01, foreach=True, maximize=True),
}


@pytest.fixture(autouse=True)
def _update_every_bucket(monkeypatch):
    """The bucket-by-bucket update merges buckets below 1 MiB: here every bucket is updated
    on its own, so the tests below see as many separate updates as buckets."""
    from bagua_hvd.torch import bucketwise

    monkeypatch.setattr(bucketwise, "_BUCKETWISE_MIN_BYTES", 0)


def _train_split(make_opt, seed, dtype, bucketwise, algorithm=None, extras=False, use_extra=False):
    """STEPS steps of the same model and batches; ``bucketwise=False`` takes Horovod's
    synchronize() + skip_synchronize() path, which updates once after every wait."""
    model = ref.make_model(seed, dtype, **({"extras": True} if extras else {}))
    kwargs = {} if algorithm is None else {"algorithm": algorithm}
    opt = hvd.DistributedOptimizer(
        make_opt(model.parameters()), named_parameters=model.named_parameters(), **kwargs
    )
    _train_steps(model, opt, seed, dtype, bucketwise, STEPS, use_extra)
    return model, opt


def _train_steps(model, opt, seed, dtype, bucketwise, steps, use_extra=False):
    for step in range(steps):
        opt.zero_grad()
        b = ref.batch(seed, step, hvd.rank(), 0, dtype=dtype)
        ref.loss_of(model, b, use_extra=use_extra).backward()
        if bucketwise:
            opt.step()
        else:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()


def _assert_same_bits(a_model, a_opt, b_model, b_opt, what):
    for (name, a), (_, b) in zip(a_model.named_parameters(), b_model.named_parameters()):
        assert torch.equal(a.detach(), b.detach()), f"{what}: {name} differs"
    for pa, pb in zip(a_model.parameters(), b_model.parameters()):
        sa, sb = a_opt.state[pa], b_opt.state[pb]
        assert sorted(sa) == sorted(sb), what
        for k in sa:
            va, vb = sa[k], sb[k]
            if torch.is_tensor(va):
                assert torch.equal(va, vb), f"{what}: state {k} differs"
            else:
                assert va == vb, f"{what}: state {k} differs"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("opt_name", list(BUCKETWISE))
def test_bucketwise_update_gives_the_same_bits(opt_name, dtype, monkeypatch):
    """step() updates each bucket's parameters as soon as that bucket is reduced: the same
    bits, parameters and optimizer state, as one update after all the waits."""
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")  # several buckets
    seed = ref.seed_for("bucketwise", opt_name, str(dtype))
    mine, opt = _train_split(BUCKETWISE[opt_name], seed, dtype, bucketwise=True)
    theirs, topt = _train_split(BUCKETWISE[opt_name], seed, dtype, bucketwise=False)
    assert len(opt._buckets) > 1
    assert opt._bucketwise_steps == STEPS - 1  # all but the first (its layout is a guess)
    assert opt._bucketwise_updates >= (STEPS - 1) * len(opt._buckets)  # one per bucket
    assert topt._bucketwise_steps == 0
    _assert_same_bits(mine, opt, theirs, topt, opt_name)


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "ef"])
def test_bucketwise_update_with_bytegrad_gives_the_same_bits(error_feedback, monkeypatch):
    from bagua_hvd.torch.algorithms import ByteGrad

    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("bucketwise_bytegrad", str(error_feedback))
    runs = [
        _train_split(_sgd, seed, torch.float32, bw, ByteGrad(error_feedback=error_feedback))
        for bw in (True, False)
    ]
    assert runs[0][1]._bucketwise_steps == STEPS - 1
    _assert_same_bits(*runs[0], *runs[1], "bytegrad")


@pytest.mark.parametrize("piece", [None, 7], ids=["whole", "pieces"])
def test_bucketwise_update_with_qadam_gives_the_same_bits(piece, monkeypatch):
    """QAdamOptimizer is updated bucket by bucket too, in warm-up and after it (the stage and
    step count are those of the whole step): the same bits as one update after all the waits;
    also with its CPU update cut into pieces of 7 elements."""
    from bagua_hvd.torch import algorithms as A

    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    if piece is not None:
        monkeypatch.setattr(A, "_PIECE", piece)
    seed = ref.seed_for("bucketwise_qadam")
    steps = STEPS + 2  # 2 warm-up steps, then 4 with the compressed momentum
    runs = []
    for bucketwise in (True, False):
        model = ref.make_model(seed, torch.float32)
        q = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2, weight_decay=0.01)
        opt = hvd.DistributedOptimizer(
            q, named_parameters=model.named_parameters(), algorithm=A.QAdamAlgorithm(q)
        )
        _train_steps(model, opt, seed, torch.float32, bucketwise, steps)
        runs.append((model, opt))
    assert len(runs[0][1]._buckets) > 1
    assert runs[0][1]._bucketwise_steps == steps - 1
    assert runs[0][1]._bucketwise_updates >= (steps - 1) * len(runs[0][1]._buckets)
    assert runs[1][1]._bucketwise_steps == 0
    assert runs[0][1].step_id == runs[1][1].step_id == steps
    _assert_same_bits(*runs[0], *runs[1], "qadam")


def test_bucketwise_update_merges_small_buckets(monkeypatch):
    """Buckets below 1 MiB are updated together (an update call has a fixed cost)."""
    from bagua_hvd.torch import bucketwise

    monkeypatch.setattr(bucketwise, "_BUCKETWISE_MIN_BYTES", 1 << 20)
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("bucketwise_merged")
    mine, opt = _train_split(_sgd, seed, torch.float64, bucketwise=True)
    theirs, topt = _train_split(_sgd, seed, torch.float64, bucketwise=False)
    assert len(opt._buckets) > 2
    assert opt._bucketwise_steps == STEPS - 1
    assert opt._bucketwise_updates == STEPS - 1  # the model is far below 1 MiB: one each
    _assert_same_bits(mine, opt, theirs, topt, "merged")


def test_bucketwise_update_falls_back_where_it_could_be_seen(monkeypatch):
    """Step hooks, a closure, a subclass of the optimizer or an optimizer outside the list: one
    update after all the waits, as before."""
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("bucketwise_fallback")

    class MySGD(torch.optim.SGD):
        pass

    cases = {
        "pre hook": (_sgd, lambda o: o.register_step_pre_hook(lambda *_: None)),
        "post hook": (_sgd, lambda o: o.register_step_post_hook(lambda *_: None)),
        "subclass": (lambda p: MySGD(p, lr=0.1), None),
        "rmsprop": (lambda p: torch.optim.RMSprop(p, lr=0.01), None),
        "closure": (_sgd, "closure"),
    }
    for what, (make, extra) in cases.items():
        model = ref.make_model(seed)
        opt = hvd.DistributedOptimizer(
            make(model.parameters()), named_parameters=model.named_parameters()
        )
        if callable(extra):
            extra(opt)
        for step in range(3):
            opt.zero_grad()
            loss = ref.loss_of(model, ref.batch(seed, step, hvd.rank(), 0))
            loss.backward()
            if extra == "closure":
                assert opt.step(lambda loss=loss: loss) is loss
            else:
                opt.step()
        assert opt._bucketwise_steps == 0, what


def test_bucketwise_update_with_unused_parameters_gives_the_same_bits(monkeypatch):
    """Parameters without a gradient on some rank (zeros are sent for them) and one without any
    gradient: the same bits as one update; and still the one-process reference's weights."""
    monkeypatch.setenv("BAGUA_HVD_BUCKET_MB", "0.0005")
    seed = ref.seed_for("bucketwise_unused")
    runs = [
        _train_split(_sgd, seed, torch.float64, bw, extras=True, use_extra=hvd.rank() % 2 == 0)
        for bw in (True, False)
    ]
    assert runs[0][1]._bucketwise_steps == STEPS - 1
    _assert_same_bits(*runs[0], *runs[1], "unused parameters")
