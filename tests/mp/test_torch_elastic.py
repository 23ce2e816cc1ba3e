"""``hvd.elastic`` for torch (TorchState, its handlers, ElasticSampler, run), run by every rank of
a launched job (or alone at size 1), in a job that is not elastic: no reset happens here.

Horovod's test_elastic_state and test_elastic_sampler (test/single/test_torch_elastic.py) are
ported so that they hold at every size: Horovod runs them at size 1 only, and its per-batch
counts of processed samples are those of one rank. The expected values follow Horovod's
semantics, worked out by hand: ``record_batch`` counts ``batch_size * size`` samples, the epoch's
order is ``list(range(n))`` shuffled by ``random.Random(seed + epoch)``, and rank r takes every
size-th sample of the unprocessed rest, from the r-th on. Run:
``bagua-run -np 3 python -m pytest -x -q tests/mp/test_torch_elastic.py``.
"""

from __future__ import annotations

import random
from typing import List

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import bagua_hvd.torch as hvd
from bagua_hvd.common.elastic import HostUpdateResult, ObjectState, notification_manager
from bagua_hvd.common.exceptions import HostsUpdatedInterrupt
from bagua_hvd.torch.elastic import ElasticSampler, TorchState
from bagua_hvd.torch.elastic.state import (
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    get_handler_registry,
    set_handler_registry,
)


def size() -> int:
    return hvd.size()


def rank() -> int:
    return hvd.rank()


class ListDataset(Dataset):
    def __init__(self, data: list) -> None:
        self.data = data

    def __getitem__(self, idx: int):
        return self.data[idx]

    def __len__(self) -> int:
        return len(self.data)


def epoch_order(length: int, seed: int, epoch: int, shuffle: bool = True) -> List[int]:
    """The epoch's order, computed here independently of the sampler (Horovod's rule)."""
    order = list(range(length))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def share(rest: List[int], num_replicas: int, r: int) -> List[int]:
    """Rank r's part of ``rest``: cycled to a multiple of num_replicas, then every
    num_replicas-th element from the r-th."""
    if not rest:
        return []
    total = -(-len(rest) // num_replicas) * num_replicas
    padded = [rest[i % len(rest)] for i in range(total)]
    return padded[r::num_replicas]


def linear(weight, bias) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model.load_state_dict({"0.weight": torch.tensor(weight), "0.bias": torch.tensor(bias)})
    return model


def assert_model(model: torch.nn.Module, weight, bias) -> None:
    sd = model.state_dict()
    assert torch.equal(sd["0.weight"], torch.tensor(weight)), sd
    assert torch.equal(sd["0.bias"], torch.tensor(bias)), sd


def assert_optimizer(optimizer: torch.optim.Optimizer, lr: float, momentum_buffer: float) -> None:
    assert optimizer.param_groups[0]["lr"] == lr
    for p in optimizer.param_groups[0]["params"]:
        buf = optimizer.state[p]["momentum_buffer"]
        assert torch.equal(buf, torch.full_like(p, momentum_buffer)), buf


# ---- the package --------------------------------------------------------------------------
def test_exports():
    assert hvd.elastic.__all__ == ["TorchState", "ElasticSampler", "run"]
    assert hvd.elastic.TorchState is TorchState
    assert hvd.elastic.ElasticSampler is ElasticSampler
    assert issubclass(TorchState, ObjectState)
    assert issubclass(ElasticSampler, torch.utils.data.Sampler)
    registry = get_handler_registry()
    assert [t for t, _ in registry] == [torch.nn.Module, torch.optim.Optimizer, ElasticSampler]
    assert [h for _, h in registry] == [
        ModelStateHandler,
        OptimizerStateHandler,
        SamplerStateHandler,
    ]


# ---- TorchState ---------------------------------------------------------------------------
def test_elastic_state():
    """Horovod's test_elastic_state, with the optimizer's state (a momentum buffer and the
    learning rate) rank-dependent too: 1 on rank 0, 2 elsewhere."""
    v = 1.0 if rank() == 0 else 2.0
    model1 = linear([[v, v], [v, v]], [v, v])
    model2 = linear([[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0])
    optimizer = torch.optim.SGD(model1.parameters(), lr=0.01 * v, momentum=0.5)
    for p in model1.parameters():
        optimizer.state[p]["momentum_buffer"] = torch.full_like(p, 10 * v)

    state = TorchState(model1, optimizer, batch=20 + rank(), epoch=10 + rank())
    assert state.model is model1 and state.optimizer is optimizer
    state.sync()

    # After sync, every value is the root rank's.
    assert_model(model1, [[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0])
    assert_optimizer(optimizer, 0.01, 10.0)
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify, then restore: back to the synchronised values.
    model1.load_state_dict(model2.state_dict())
    optimizer.param_groups[0]["lr"] = 0.5
    for p in model1.parameters():
        optimizer.state[p]["momentum_buffer"].fill_(7.0)
    state.batch = 21
    state.epoch = 11

    state.restore()

    assert_model(model1, [[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0])
    assert_optimizer(optimizer, 0.01, 10.0)
    assert state.batch == 20
    assert state.epoch == 10

    # Partially modify, then commit: restore keeps the modified values.
    model1.load_state_dict(model2.state_dict())
    optimizer.param_groups[0]["lr"] = 0.5
    for p in model1.parameters():
        optimizer.state[p]["momentum_buffer"].fill_(7.0)
    state.batch = 21
    state.epoch = 11

    state.commit()
    state.restore()

    assert_model(model1, [[1.0, 2.0], [3.0, 4.0]], [0.0, 0.0])
    assert_optimizer(optimizer, 0.5, 7.0)
    assert state.batch == 21
    assert state.epoch == 11


def test_none_model_and_optimizer_are_plain_attributes():
    state = TorchState(step=rank())
    assert state._handlers == {}
    assert state.model is None and state.optimizer is None
    state.sync()
    assert (state.model, state.optimizer, state.step) == (None, None, 0)


def test_assigning_a_handled_attribute_sets_and_saves_it():
    v = float(rank() + 1)
    model1 = linear([[v, v], [v, v]], [v, v])
    model2 = linear([[10 * v, 0.0], [0.0, 10 * v]], [v, -v])
    state = TorchState(model=model1, batch=0)
    assert set(state._handlers) == {"model"}

    state.model = model2  # the handler now keeps model2, saved as it is now
    assert state.model is model2
    assert state._handlers["model"].value is model2
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    state.restore()
    assert_model(model2, [[10 * v, 0.0], [0.0, 10 * v]], [v, -v])
    assert_model(model1, [[v, v], [v, v]], [v, v])

    # sync broadcasts the new model, not the old one
    state.sync()
    assert_model(model2, [[10.0, 0.0], [0.0, 10.0]], [1.0, -1.0])
    assert_model(model1, [[v, v], [v, v]], [v, v])

    # a plain attribute is not saved by assignment
    state.batch = 5
    state.restore()
    assert state.batch == 0


class Counter:
    def __init__(self, n: int) -> None:
        self.n = n


class CounterHandler(StateHandler):
    def __init__(self, counter: Counter) -> None:
        super().__init__(counter)
        self._saved = counter.n

    def save(self) -> None:
        self._saved = self.value.n

    def restore(self) -> None:
        self.value.n = self._saved

    def sync(self) -> None:
        self.value.n = hvd.broadcast_object(self.value.n, name="test.counter")


def test_set_handler_registry_replaces_the_registry():
    original = get_handler_registry()
    try:
        set_handler_registry([(Counter, CounterHandler)])
        assert get_handler_registry() == [(Counter, CounterHandler)]
        # The default types are no longer handled (this state is not synchronised: it would
        # broadcast the pickled sampler).
        sampler = ElasticSampler(list(range(4)))
        assert TorchState(sampler=sampler)._handlers == {}

        counter = Counter(rank() + 3)
        state = TorchState(counter=counter)
        assert set(state._handlers) == {"counter"}
        assert state.counter is counter
        state.sync()
        assert counter.n == 3
        counter.n = 9
        state.restore()
        assert counter.n == 3
        state.on_reset()  # a handler without a reset() of its own
    finally:
        set_handler_registry(original)
    assert get_handler_registry() is original


def test_reset_callbacks_and_sampler_repartition():
    """state.on_reset(), what run() calls after each reset (also when the sync is skipped):
    the samplers take the job's rank and size, then the callbacks run in order."""
    length = 40
    sampler = ElasticSampler(list(range(length)), seed=5)
    state = TorchState(sampler=sampler)
    calls = []
    state.register_reset_callbacks([lambda: calls.append(("a", sampler.num_replicas))])
    state.register_reset_callbacks([lambda: calls.append(("b", sampler.rank))])

    # The partition of the world before the reset: one rank more, this rank last.
    sampler._set_world(size() + 1, size())
    sampler.record_batch(0, 2)
    processed = 2 * (size() + 1)
    assert sampler.processed_num == processed
    state._host_messages.put((5, HostUpdateResult.added))

    state.on_reset()

    assert calls == [("a", size()), ("b", rank())]
    assert (sampler.num_replicas, sampler.rank) == (size(), rank())
    assert sampler.processed_num == processed
    expected = share(epoch_order(length, 5, 0)[processed:], size(), rank())
    assert list(sampler) == expected
    assert len(sampler) == len(expected)
    assert state._host_messages.empty()  # updates queued before the reset are dropped


def commit_outcome(state: TorchState):
    """None when commit() returns; the interrupt's skip_sync when it raises."""
    try:
        state.commit()
    except HostsUpdatedInterrupt as e:
        return e.skip_sync
    return None


def test_commit_raises_hosts_updated_on_every_rank():
    state = TorchState(batch=0)
    assert state._last_updated_timestamp == 0
    assert commit_outcome(state) is None

    # An added host, heard by rank 0 only: every rank raises, and will sync.
    if rank() == 0:
        state._host_messages.put((1, HostUpdateResult.added))
    state.batch = 1
    assert commit_outcome(state) is False
    assert state._last_updated_timestamp == 1
    state.batch = 2
    state.restore()
    assert state.batch == 1  # commit saved before it raised

    assert commit_outcome(state) is None  # the same update is not raised twice

    # Hosts only removed: the survivors may skip the sync.
    if rank() == 0:
        state._host_messages.put((2, HostUpdateResult.removed))
    assert commit_outcome(state) is True

    # Removed then added: mixed, a sync.
    if rank() == 0:
        state._host_messages.put((3, HostUpdateResult.removed))
        state._host_messages.put((4, HostUpdateResult.added))
    assert commit_outcome(state) is False
    assert state._last_updated_timestamp == 4

    # Updates not newer than the last one seen are ignored.
    if rank() == 0:
        state._host_messages.put((4, HostUpdateResult.added))
        state._host_messages.put((2, HostUpdateResult.removed))
    assert commit_outcome(state) is None

    # Only rank 0's view counts.
    if rank() != 0:
        state._host_messages.put((10, HostUpdateResult.added))
    assert commit_outcome(state) is None
    assert state._last_updated_timestamp == 4

    # check_host_updates() alone raises the same way.
    if rank() == 0:
        state._host_messages.put((11, HostUpdateResult.removed))
    with pytest.raises(HostsUpdatedInterrupt) as info:
        state.check_host_updates()
    assert info.value.skip_sync is True
    assert state._last_updated_timestamp == 11


# ---- run ----------------------------------------------------------------------------------
def test_run_syncs_the_state_then_returns_the_result():
    v = 1.0 if rank() == 0 else 2.0
    model = linear([[v, v], [v, v]], [v, v])
    state = TorchState(model, batch=100 + rank())
    calls = []

    @hvd.elastic.run
    def train(state, a, b=0):
        """Returns what it saw."""
        calls.append(a)
        return state.batch, state.model.state_dict()["0.bias"].tolist(), a, b

    assert train.__name__ == "train" and train.__doc__ == "Returns what it saw."
    assert train(state, 1, b=2) == (100, [1.0, 1.0], 1, 2)
    assert calls == [1]
    assert_model(model, [[1.0, 1.0], [1.0, 1.0]], [1.0, 1.0])
    assert state not in notification_manager._listeners

    @hvd.elastic.run
    def fails(state):
        raise ValueError("not an elastic error")

    # Other exceptions propagate, without a reset.
    with pytest.raises(ValueError, match="not an elastic error"):
        fails(state)
    assert hvd.is_initialized()
    assert state not in notification_manager._listeners


# ---- ElasticSampler ------------------------------------------------------------------------
def test_elastic_sampler():
    """Horovod's test_elastic_sampler at any size: 8 samples per rank, batches of 2."""
    batch_size = 2
    samples_per_worker = 8
    n = size()
    length = samples_per_worker * n
    dataset = ListDataset(list(range(length)))
    sampler = ElasticSampler(dataset, shuffle=True)
    data_loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    state = TorchState(sampler=sampler)
    state.sync()

    assert state.sampler is sampler
    assert state.sampler.epoch == 0
    assert state.sampler.processed_num == 0

    # Normal usage, no errors: each batch counts batch_size samples of every rank.
    epochs = 2
    total_batches = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        seen = []
        for batch_idx, batch in enumerate(data_loader):
            sampler.record_batch(batch_idx, batch_size)
            assert sampler.processed_num == batch_size * n * (batch_idx + 1)
            seen += batch.tolist()
            total_batches += 1
        assert seen == epoch_order(length, 0, epoch)[rank() :: n]
        everyone = hvd.allgather_object(seen, name=f"test.sampler.epoch{epoch}")
        assert sorted(sum(everyone, [])) == list(range(length))
    assert total_batches == (samples_per_worker // batch_size) * epochs

    # Without set_epoch the partition is not recomputed: the data loader repeats the epoch,
    # and processed_num stays at the whole epoch.
    total_batches = 0
    for _ in enumerate(data_loader):
        assert sampler.processed_num == samples_per_worker * n
        assert len(sampler) == samples_per_worker
        total_batches += 1
    assert total_batches == samples_per_worker // batch_size

    # Elastic: partial epoch + commit
    sampler.set_epoch(2)
    assert sampler.processed_num == 0

    sampler.record_batch(0, batch_size)
    sampler.record_batch(1, batch_size)
    assert sampler.processed_num == 2 * batch_size * n

    committed_num = sampler.processed_num
    state.commit()

    # Elastic: partial epoch + restore
    sampler.record_batch(2, batch_size)
    sampler.record_batch(3, batch_size)
    assert sampler.processed_num == 4 * batch_size * n

    state.restore()

    assert sampler.processed_num == 2 * batch_size * n
    assert sampler.processed_num == committed_num
    assert len(sampler) == samples_per_worker - 2 * batch_size

    # Elastic: sync across workers and verify non-overlap of processed samples
    sampler.record_batch(2, batch_size)
    assert sampler.processed_num == 3 * batch_size * n

    state.commit()
    state.sync()

    assert sampler.processed_num == 3 * batch_size * n

    # After the sync, the remaining indices are repartitioned: one batch left on each rank.
    assert len(sampler) == batch_size
    batches = [batch.tolist() for batch in data_loader]
    assert batches == [epoch_order(length, 0, 2)[3 * batch_size * n :][rank() :: n]]

    # Proceed to the next epoch, which resets the state
    sampler.set_epoch(3)
    assert len(sampler) == samples_per_worker
    total_batches = 0
    for _ in enumerate(data_loader):
        total_batches += 1
    assert total_batches == samples_per_worker // batch_size


def test_sampler_api():
    sampler = ElasticSampler(list(range(10)), shuffle=False, seed=3)
    assert (sampler.shuffle, sampler.seed, sampler.epoch, sampler.processed_num) == (
        False,
        3,
        0,
        0,
    )
    assert sampler.processed_indices == set()  # Horovod's unused field of its old API
    assert (sampler.num_replicas, sampler.rank) == (size(), rank())
    assert list(sampler) == share(list(range(10)), size(), rank())
    assert len(sampler) == -(-10 // size())
    assert sampler.total_size == len(sampler) * size()

    sampler.record_batch(123, 2)  # batch_idx is not used
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 2 * size()}
    sampler.load_state_dict({"epoch": 4, "processed_num": 3})
    assert (sampler.epoch, sampler.processed_num) == (4, 3)
    assert list(sampler) == share(list(range(3, 10)), size(), rank())
    sampler.set_epoch(5)
    assert sampler.state_dict() == {"epoch": 5, "processed_num": 0}

    with pytest.raises(ValueError):
        sampler._set_world(2, 2)


# (dataset length, batch size, full batches done per rank at size A, A, B, shuffle)
RESIZE_CASES = [
    (24, 2, 2, 3, 2, True),
    (24, 2, 3, 2, 3, True),
    (25, 3, 1, 4, 3, True),  # the rest (13) padded to 15 at B
    (17, 2, 4, 1, 4, True),  # the rest (9) padded to 12
    (30, 1, 0, 3, 5, False),
    (10, 1, 3, 2, 7, True),  # the rest (4) padded to 7
    (10, 2, 2, 2, 7, True),  # the rest (2) shorter than its padding (5): cycled
    (12, 2, 3, 2, 5, True),  # the whole epoch done: nothing left
]


@pytest.mark.parametrize("length,batch_size,k,a_size,b_size,shuffle", RESIZE_CASES)
def test_sampler_resumes_after_a_resize(length, batch_size, k, a_size, b_size, shuffle):
    """Every sample of an epoch is processed once across a resize: k full batches per rank at
    size A, the state saved, loaded at size B. The sampler's own partition (its reset path,
    with the world given through _set_world) against the order computed here."""
    seed, epoch = 7, 3
    dataset = list(range(length))
    order = epoch_order(length, seed, epoch, shuffle)

    consumed: List[int] = []
    saved = []
    for a in range(a_size):
        sampler = ElasticSampler(dataset, shuffle=shuffle, seed=seed)
        sampler.set_epoch(epoch)
        sampler._set_world(a_size, a)
        it = iter(sampler)
        mine = []
        for batch_idx in range(k):
            mine += [next(it) for _ in range(batch_size)]
            sampler.record_batch(batch_idx, batch_size)
        assert mine == order[a::a_size][: k * batch_size]
        consumed += mine
        saved.append(sampler.state_dict())
    processed = k * batch_size * a_size
    assert saved == [{"epoch": epoch, "processed_num": processed}] * a_size
    assert sorted(consumed) == sorted(order[:processed])  # a prefix of the epoch's order

    rest: List[int] = []
    for b in range(b_size):
        sampler = ElasticSampler(dataset, shuffle=shuffle, seed=seed)
        sampler.load_state_dict(saved[0])
        sampler._set_world(b_size, b)
        mine = list(sampler)
        assert mine == share(order[processed:], b_size, b)
        assert len(sampler) == len(mine)
        rest += mine

    remaining = length - processed
    padding = -(-remaining // b_size) * b_size - remaining
    assert len(consumed) == len(set(consumed))
    assert not set(consumed) & set(rest)
    assert set(consumed) | set(rest) == set(range(length))
    assert len(rest) - len(set(rest)) == padding
