"""Static and dynamic process sets, run by every rank of a launched job (or alone at size 1)."""

from __future__ import annotations

import os

import pytest
import reference as ref
import torch
from helpers import check, inputs_for, to_torch

import bagua_hvd.torch as hvd

# Members and non-members of a set enqueue different numbers of ops: every op here is named
# (and the unnamed-op probe after each test is skipped).
pytestmark = pytest.mark.handles_may_diverge


def hvd_size_of_job() -> int:
    """The job's size while the runtime is down (the launcher's variable; 1 without one)."""
    return int(os.environ.get("HOROVOD_SIZE", "1"))


def _reinit(**kwargs) -> None:
    """Re-initializes every rank. Any rank's shutdown stops the whole job (Horovod semantics),
    so ranks first wait for each other."""
    if hvd.is_initialized():
        hvd.barrier()
    hvd.shutdown()
    hvd.init(**kwargs)


@pytest.fixture
def restore_default():
    """Leaves the job initialized without process sets and without dynamic sets."""
    saved = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS")
    yield
    if saved is None:
        os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    else:
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = saved
    _reinit()


def _set_specs(n: int) -> list:
    """Distinct rank lists for this job size: evens, the last rank, and everyone."""
    specs = []
    for ranks in (list(range(0, n, 2)), [n - 1], list(range(n))):
        if ranks not in specs:
            specs.append(ranks)
    return specs


def _exercise(ps: hvd.ProcessSet, tag: str) -> None:
    """Every collective inside ``ps`` (members) or the non-member error (others).

    Members and non-members enqueue different numbers of ops: every op in this file is named.
    """
    me = hvd.rank()
    members = ps.ranks
    if me not in members:
        assert ps.included() is False
        with pytest.raises(ValueError, match="Process is not part of provided process set."):
            ps.rank()
        with pytest.raises(
            ValueError, match=f"Allreduce: Rank {me} is not a member of the provided process set."
        ):
            hvd.allreduce(torch.ones(3), process_set=ps)
        with pytest.raises(ValueError, match=f"Rank {me} is not a member"):
            hvd.allgather(torch.ones(3), process_set=ps)
        return
    k, idx = len(members), members.index(me)
    assert ps.included() is True and ps.size() == k and ps.rank() == idx
    dtype = "float32"
    inputs = inputs_for(("ps", tag), k, lambda r: (4, 3), dtype)
    mine = to_torch(inputs[idx], dtype)
    check(
        hvd.allreduce(mine, op=hvd.Sum, process_set=ps, name=f"{tag}.sum"),
        ref.allreduce(inputs, ref.SUM, dtype),
        dtype,
        0,
        f"{tag} allreduce",
    )
    check(
        hvd.allreduce(mine, process_set=ps, name=f"{tag}.avg"),
        ref.allreduce(inputs, ref.AVERAGE, dtype),
        dtype,
        ref.tolerance(dtype, ref.AVERAGE, k),
        f"{tag} average over the set",
    )
    ag_inputs = inputs_for(("ps-ag", tag), k, lambda r: (r + 1, 2), dtype)
    check(
        hvd.allgather(to_torch(ag_inputs[idx], dtype), process_set=ps, name=f"{tag}.ag"),
        ref.allgather(ag_inputs),
        dtype,
        0,
        f"{tag} allgather",
    )
    root = members[-1]  # a GLOBAL rank
    check(
        hvd.broadcast(mine, root, process_set=ps, name=f"{tag}.bc"),
        ref.broadcast(inputs, k - 1),
        dtype,
        0,
        f"{tag} broadcast",
    )
    splits = [[(s + q) % 2 + 1 for q in range(k)] for s in range(k)]
    a2a_inputs = inputs_for(("ps-a2a", tag), k, lambda r: (sum(splits[r]), 2), dtype)
    out, rsplits = hvd.alltoall(
        to_torch(a2a_inputs[idx], dtype), splits=splits[idx], process_set=ps, name=f"{tag}.a2a"
    )
    exp, exp_splits = ref.alltoall(a2a_inputs, splits, idx)
    check(out, exp, dtype, 0, f"{tag} alltoall")
    assert rsplits.tolist() == exp_splits
    rs_inputs = inputs_for(("ps-rs", tag), k, lambda r: (2 * k + 1, 2), dtype)
    check(
        hvd.reducescatter(
            to_torch(rs_inputs[idx], dtype), op=hvd.Sum, process_set=ps, name=f"{tag}.rs"
        ),
        ref.reducescatter(rs_inputs, ref.SUM, dtype, idx),
        dtype,
        0,
        f"{tag} reducescatter",
    )
    hvd.barrier(process_set=ps)
    if k > 1 or hvd.size() > 1:
        with pytest.raises(
            NotImplementedError, match="Adasum does not support non-global process sets yet."
        ):
            hvd.allreduce(mine, op=hvd.Adasum, process_set=ps)
    bad_root = next((r for r in range(hvd.size()) if r not in members), None)
    if bad_root is not None:
        with pytest.raises(ValueError, match=f"broadcast received invalid root rank {bad_root}"):
            hvd.broadcast(mine, bad_root, process_set=ps)


def _global_still_works() -> None:
    n = hvd.size()
    got = hvd.allreduce(torch.full((3,), float(hvd.rank() + 1)), op=hvd.Sum, name="global")
    assert torch.equal(got, torch.full((3,), n * (n + 1) / 2))


def test_static_process_sets(restore_default):
    n = hvd.size()
    # As Horovod: a static set with every rank is the global set, so passing one is a
    # duplicate (the runtime starts anyway).
    everyone = hvd.ProcessSet(range(n))
    with pytest.raises(ValueError, match="entry number 0 is a duplicate"):
        _reinit(process_sets=[everyone])
    assert hvd.is_initialized() and everyone.process_set_id is None
    if n == 1:
        return  # every set of one rank is the global set
    sets = [hvd.ProcessSet(r) for r in _set_specs(n) if r != list(range(n))]
    _reinit(process_sets=sets)
    for i, ps in enumerate(sets, start=1):
        assert ps.process_set_id == i, str(ps)
        assert str(ps) == f"ProcessSet(process_set_id={i}, ranks={ps.ranks}, mpi_comm=None)"
    for i, ps in enumerate(sets):
        _exercise(ps, f"static{i}")
        _global_still_works()
    # concurrent async ops on different sets and the global set keep one total order
    handles = []
    for rep in range(3):
        for ps in sets:
            if ps.included():
                handles.append(
                    (
                        ps,
                        hvd.allreduce_async(
                            torch.ones(5),
                            op=hvd.Sum,
                            name=f"conc.{ps.process_set_id}.{rep}",
                            process_set=ps,
                        ),
                    )
                )
        handles.append(
            (
                hvd.global_process_set,
                hvd.allreduce_async(torch.ones(5), op=hvd.Sum, name=f"conc.g.{rep}"),
            )
        )
    for ps, h in handles:
        assert torch.equal(hvd.synchronize(h), torch.full((5,), float(ps.size())))
    # static sets cannot change without dynamic process sets
    with pytest.raises(ValueError, match="Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding"):
        hvd.add_process_set([0])
    with pytest.raises(ValueError, match="Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing"):
        hvd.remove_process_set(sets[0])
    assert hvd.remove_process_set(hvd.global_process_set) is False


def test_init_rejects_duplicate_sets(restore_default):
    hvd.shutdown()
    if hvd_size_of_job() == 1:  # a set of rank 0 is the global set: already the first entry
        with pytest.raises(ValueError, match="entry number 0 is a duplicate: ProcessSet"):
            hvd.init(process_sets=[hvd.ProcessSet([0])])
        assert hvd.is_initialized()
        hvd.shutdown()
        return
    a, b = hvd.ProcessSet([0]), hvd.ProcessSet([0])
    with pytest.raises(
        ValueError,
        match="Horovod could not be initialized because process_sets "
        "entry number 1 is a duplicate: ProcessSet",
    ):
        hvd.init(process_sets=[a, b])
    # As Horovod (horovod/common/basics.py): the runtime started and registered the set once;
    # the duplicate entry is invalidated, and an init() with a valid list maps onto what is
    # registered.
    assert hvd.is_initialized() and a.process_set_id == 1 and b.process_set_id is None
    assert hvd.mpi_ops._basics._get_process_set_ids_and_ranks() == {0: list(range(hvd.size())), 1: [0]}
    c = hvd.ProcessSet([0])
    hvd.init(process_sets=[c])
    assert c.process_set_id == 1
    with pytest.raises(ValueError, match="entry number 0 .* was not registered when Horovod"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 1])] if hvd.size() > 1 else [hvd.ProcessSet([5])])
    hvd.shutdown()
    # Horovod's texts (process_set.cc, RegisterProcessSet).
    with pytest.raises(ValueError, match="Tried to register process set with invalid rank: 10000"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 10_000])])
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="Tried to register process set with duplicate rank: 0"):
        hvd.init(process_sets=[hvd.ProcessSet([0, 0])])
    assert not hvd.is_initialized()


def test_unregistered_sets():
    ps = hvd.ProcessSet([2, 0, 1])
    assert ps.ranks == [0, 1, 2]
    assert ps.process_set_id is None and ps.size() is None and ps.rank() is None
    assert ps.included() is None
    assert hvd.remove_process_set(ps) is False


def test_dynamic_process_sets(restore_default):
    n = hvd.size()
    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    _reinit(process_sets="dynamic")
    assert os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] == "1"
    # a set with the global set's ranks is a duplicate of the global set
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set: "):
        hvd.add_process_set(list(range(n)))
    # Ranks outside the job or given twice: Horovod's texts (process_set.cc), on every rank, and
    # the job goes on.
    for bad, text in (([0, n], f"invalid rank: {n}"), ([0, 0], "duplicate rank: 0")):
        with pytest.raises(ValueError, match=f"Tried to register process set with {text}"):
            hvd.add_process_set(bad)
    _global_still_works()
    specs = [s for s in _set_specs(n) if s != list(range(n))]
    if not specs:
        return  # size 1: the only possible set is the global one
    added = []
    for i, ranks in enumerate(specs):
        ps = hvd.add_process_set(ranks if i % 2 else hvd.ProcessSet(ranks))
        assert isinstance(ps, hvd.ProcessSet) and ps.process_set_id not in (None, 0)
        added.append(ps)
    assert len({ps.process_set_id for ps in added}) == len(added)
    for i, ps in enumerate(added):
        _exercise(ps, f"dyn{i}")
    with pytest.raises(ValueError, match="Attempted to add a duplicate process set: "):
        hvd.add_process_set(list(added[0].ranks))
    # remove one, its ops fail, re-add the same ranks: a working set again
    victim = added[0]
    assert hvd.remove_process_set(victim) is True
    assert victim.process_set_id is None
    assert hvd.remove_process_set(victim) is False
    with pytest.raises(ValueError, match="Allreduce: Process set provided does not exist"):
        hvd.allreduce(torch.ones(2), process_set=victim)
    again = hvd.add_process_set(victim.ranks)
    assert again.process_set_id is not None
    _exercise(again, "dyn-again")
    _global_still_works()
    for ps in [again, *added[1:]]:
        assert hvd.remove_process_set(ps) is True
    _global_still_works()


def test_dynamic_via_environment(restore_default):
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    _reinit()
    n = hvd.size()
    if n == 1:
        with pytest.raises(ValueError, match="Attempted to add a duplicate process set"):
            hvd.add_process_set([0])
        return
    ranks = [0, n - 1] if n > 2 else [n - 1]
    ps = hvd.add_process_set(ranks)
    if ps.included():
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps, name="env")
        assert torch.equal(got, torch.full((2,), float(len(ranks))))
    assert hvd.remove_process_set(ps) is True


def test_static_and_dynamic_together(restore_default):
    n = hvd.size()
    if n == 1:
        pytest.skip("a static set of one rank is the global set at size 1")
    static = hvd.ProcessSet(list(range(n - 1)))
    os.environ.pop("HOROVOD_DYNAMIC_PROCESS_SETS", None)
    _reinit(process_sets=[static])
    assert static.process_set_id == 1
    _reinit()
    # after a re-init without sets, the old object no longer refers to a registered set
    assert static.process_set_id is None
    hvd.barrier()
    hvd.shutdown()
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "1"
    hvd.init(process_sets=[static])
    assert static.process_set_id == 1
    if static.included():
        got = hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=static, name="static")
        assert got.tolist() == [float(n - 1)]
    if n > 1:
        extra = hvd.add_process_set([n - 1])
        assert extra.process_set_id not in (None, 0, 1)
        if hvd.rank() == n - 1:
            assert (
                hvd.allreduce(torch.ones(1), op=hvd.Sum, process_set=extra, name="extra").item()
                == 1.0
            )


def test_same_names_in_disjoint_sets(restore_default):
    """Names are unique per process set, as in Horovod: two disjoint sets may run ops with the
    same name (here unnamed ones, named from equal handle counters) at the same time."""
    n = hvd.size()
    if n == 1:
        pytest.skip("needs two disjoint sets (at size 1 a set of rank 0 is the global set)")
    evens = hvd.ProcessSet(list(range(0, n, 2)))
    odds = hvd.ProcessSet(list(range(1, n, 2)))
    sets = [evens] + ([odds] if odds else [])
    _reinit(process_sets=sets)
    mine = evens if evens.included() else odds
    for _ in range(20):
        got = hvd.allreduce(torch.full((4,), float(hvd.rank())), op=hvd.Sum, process_set=mine)
        assert torch.equal(got, torch.full((4,), float(sum(mine.ranks))))
        got = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=mine, name="same")
        assert torch.equal(got, torch.full((3,), float(mine.size())))
    _global_still_works()
