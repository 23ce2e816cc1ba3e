"""op=hvd.Adasum in bagua_hvd.torch: the allreduce (one, grouped, fused, scaled) and the
DistributedOptimizer's delta optimizer, run by every rank of a launched job (or alone at size 1).

References: ``reference.adasum`` (Adasum's tree from its definition, numpy) over every rank's
seeded inputs, and for the optimizer a simulation of all ranks in this process with plain torch
(each rank's SGD step on its own batch, the deltas combined by ``reference.adasum``). At a size
that is not a power of 2 every rank gets Horovod's NotImplementedError and the job goes on.
Run: ``bagua-run -np 4 python -m pytest -q tests/mp/test_torch_adasum.py``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import reference as ref
import torch
from helpers import TORCH_DTYPES, check

import bagua_hvd.torch as hvd

hvd.init()
SIZE, RANK = hvd.size(), hvd.rank()
POWER_OF_2 = SIZE & (SIZE - 1) == 0
NOT_POWER_OF_2 = "Running Adasum with non-power of 2 ranks is not supported yet."
TOL = {"float16": 1e-2, "float32": 1e-5, "float64": 1e-12}
power_of_2 = pytest.mark.skipif(not POWER_OF_2, reason="Adasum runs on 2^k ranks (errors below)")
not_power_of_2 = pytest.mark.skipif(POWER_OF_2, reason="the error of a size that is not 2^k")


def inputs(case: str, shape: tuple, dtype: str) -> list:
    return ref.normal_inputs(case, SIZE, shape, dtype)


def assert_job_works(tag: str) -> None:
    got = hvd.allreduce(torch.full((3,), float(RANK + 1)), op=hvd.Sum, name=f"adasum.works.{tag}")
    assert torch.equal(got, torch.full((3,), float(SIZE * (SIZE + 1) // 2))), got


@power_of_2
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize("shape", [(1,), (17,), (3, 4, 5), (1000,)])
def test_allreduce_adasum_is_the_tree(dtype, shape):
    xs = inputs(f"one{shape}", shape, dtype)
    got = hvd.allreduce(torch.from_numpy(xs[RANK]), op=hvd.Adasum, name=f"ada.{dtype}.{shape}")
    check(got, ref.adasum(xs, dtype), dtype, TOL[dtype] * 10, "allreduce(op=Adasum)")


@power_of_2
def test_in_place_and_scale_factors():
    # Adasum is scale-equivariant, so the factors scale the result (Horovod applies them before
    # and after the reduction).
    xs = inputs("scaled", (33,), "float64")
    t = torch.from_numpy(xs[RANK].copy())
    hvd.allreduce_(t, op=hvd.Adasum, prescale_factor=0.5, postscale_factor=3.0, name="ada.sc")
    check(t, 1.5 * ref.adasum(xs), "float64", 1e-12, "allreduce_(op=Adasum) with factors")


@power_of_2
def test_grouped_tensors_have_their_own_coefficients():
    # Tensor a points the same way on every rank (Adasum: its mean), b is random: combined as one
    # vector their coefficients would mix.
    bs = inputs("grouped.b", (5, 2), "float32")
    a = torch.full((7,), float(RANK + 1), dtype=torch.float32)
    outs = hvd.grouped_allreduce([a, torch.from_numpy(bs[RANK])], op=hvd.Adasum, name="ada.g")
    check(outs[0], np.full((7,), (SIZE + 1) / 2.0), "float32", 1e-5, "grouped tensor a")
    check(outs[1], ref.adasum(bs, "float32"), "float32", 1e-4, "grouped tensor b")


@power_of_2
def test_many_in_flight_are_fused_and_each_is_right():
    shapes = [(3,), (64,), (1,), (9, 9), (100,)]
    xs = [inputs(f"fused{i}", s, "float32") for i, s in enumerate(shapes)]
    handles = [
        hvd.allreduce_async(torch.from_numpy(x[RANK]), op=hvd.Adasum, name=f"ada.f{i}")
        for i, x in enumerate(xs)
    ]
    for i, (h, x) in enumerate(zip(handles, xs)):
        check(hvd.synchronize(h), ref.adasum(x, "float32"), "float32", 1e-4, f"fused tensor {i}")


@pytest.mark.parametrize("dtype", ["int32", "bfloat16"])
def test_other_dtypes_are_refused_on_every_rank(dtype):
    if SIZE == 1:
        pytest.skip("at size 1 the allreduce returns its input")
    with pytest.raises((ValueError, NotImplementedError), match="Adasum"):
        hvd.allreduce(torch.ones(4, dtype=TORCH_DTYPES[dtype]), op=hvd.Adasum, name="ada.bad")
    assert_job_works(f"dtype.{dtype}")


def test_reducescatter_refuses_adasum():
    # Horovod's test_horovod_reducescatter_adasum expects a RuntimeError.
    with pytest.raises(RuntimeError, match="Reducescatter currently only supports AVERAGE"):
        hvd.reducescatter(torch.ones(4 * SIZE), op=hvd.Adasum)
    assert_job_works("reducescatter")


@not_power_of_2
def test_size_not_a_power_of_2_is_refused():
    with pytest.raises(NotImplementedError, match=NOT_POWER_OF_2):
        hvd.allreduce(torch.ones(4), op=hvd.Adasum)
    assert_job_works("size")


# ---- DistributedOptimizer(op=Adasum): Horovod's delta optimizer ------------------------------
def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def batch(rank: int, step: int, micro: int = 0) -> tuple:
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (4,), generator=g
    )


def reference_steps(steps: int, passes: int, lr: float = 0.1) -> list:
    """Every rank's model in this process: per step each one's SGD(momentum) update from the
    shared weights on its own batches (gradients summed over ``passes`` backward passes), then
    the weights = start + Adasum of the updates. The weights after each step."""
    models = [make_model() for _ in range(SIZE)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    out = []
    for step in range(steps):
        start = [p.detach().clone() for p in models[0].parameters()]
        deltas = []
        for k, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            for micro in range(passes):
                x, y = batch(k, step, micro)
                torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            deltas.append([(p.detach() - s).numpy() for p, s in zip(m.parameters(), start)])
        new = [
            s + torch.from_numpy(ref.adasum([d[i] for d in deltas])) for i, s in enumerate(start)
        ]
        for m in models:
            with torch.no_grad():
                for p, v in zip(m.parameters(), new):
                    p.copy_(v)
        out.append([v.clone() for v in new])
    return out


@power_of_2
@pytest.mark.parametrize("passes", [1, 2])
def test_distributed_optimizer_combines_the_updates(passes):
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
        backward_passes_per_step=passes,
    )
    assert type(opt).__name__ == "SGD" and isinstance(opt, torch.optim.SGD)
    expected = reference_steps(3, passes)
    for step in range(3):
        opt.zero_grad()
        for micro in range(passes):
            x, y = batch(RANK, step, micro)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        for p, e in zip(model.parameters(), expected[step]):
            np.testing.assert_allclose(
                p.detach().numpy(), e.numpy(), rtol=0, atol=1e-12, err_msg=f"step {step}"
            )


@power_of_2
def test_distributed_optimizer_horovod_contract():
    if SIZE == 1:
        pytest.skip("at size 1 op=Adasum gives Horovod's plain DistributedOptimizer")
    model = make_model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=hvd.Adasum,
    )
    opt.synchronize()  # nothing to do, as Horovod's
    with pytest.raises(AssertionError, match="Skipping synchronization is not supported"):
        with opt.skip_synchronize():
            pass
    x, y = batch(RANK, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(AssertionError, match="zero_grad\\(\\) was called after loss.backward"):
        opt.zero_grad()
    opt.step()
    with pytest.raises(NotImplementedError, match="non-global process sets"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            op=hvd.Adasum,
            process_set=hvd.ProcessSet([0, 1]),
        )


def test_size_1_optimizer_is_horovods_plain_one():
    if SIZE != 1:
        pytest.skip("size 1 only")
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    x, y = batch(0, 0)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for m, o in ((model, opt), (ref_model, ref_opt)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
