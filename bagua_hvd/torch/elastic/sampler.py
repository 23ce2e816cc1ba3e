"""``ElasticSampler`` (``horovod.torch.elastic.sampler``, Horovod >= 0.24 semantics): a sampler
that splits the rest of an epoch over whatever ranks the job has after a reset.

The epoch's order is ``list(range(len(dataset)))``, shuffled in place by
``random.Random(seed + epoch)`` when ``shuffle`` is set: the same on every rank and at every
world size, and the same as Horovod's. ``processed_num`` counts the samples of that order that
the whole job has consumed (a prefix of it, when every rank takes full, equal batches); the
remaining ones are dealt round-robin over the ranks, padded at the end so that every rank gets
the same number.
"""

from __future__ import annotations

import random
from typing import Any, Dict, Iterator, List, Sized

import torch.utils.data

from bagua_hvd.torch.mpi_ops import rank, size

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Sampler that partitions dataset across ranks and repartitions after reset events.

    Works like ``DistributedSampler``, but records how many samples of the epoch were processed,
    so that a ``TorchState`` holding it re-splits only the unprocessed rest of the epoch among
    the workers of the job after a reset.

    To use it:

    1. Include this object in the ``TorchState``.
    2. Call ``record_batch`` after processing a batch of samples.
    3. Call ``set_epoch`` at the end of each epoch, to start the next one from its beginning.

    The accounting assumes that every rank processes full batches of the same size: a partial
    last batch, or the padding duplicates at the end of an epoch, are counted as new samples.

    Args:
        dataset: Dataset used for sampling (assumed to be of constant size).
        shuffle: If ``True`` (default), shuffle the indices.
        seed: Random seed used to shuffle the sampler when ``shuffle=True``. This number should
            be identical across all ranks (default: 0).

    ``hvd.init()`` must have been called: the constructor reads the rank and size.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        # torch.utils.data.Sampler.__init__ is not called, as in Horovod: its signature differs
        # between torch versions, and it sets nothing this class uses.
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed

        self.epoch = 0
        # Horovod still sets this field of its pre-0.24 API; kept so that code reading it works.
        self.processed_indices: set = set()

        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.processed_num = 0

        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch for this sampler.

        When ``shuffle=True``, this makes every epoch use a different random ordering (the same
        on all replicas).

        Clears the count of processed samples for the next epoch. Call it at the end of the
        epoch, not at the beginning, or a partly completed epoch would be processed again from
        its start after a reset.

        Args:
            epoch: Epoch number.
        """
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Records that a batch was processed: ``batch_size`` samples on every rank, so
        ``processed_num`` grows by ``batch_size * num_replicas`` (``batch_idx`` is not used)."""
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Sets ``epoch`` and ``processed_num`` from ``state_dict`` and re-partitions the rest of
        the epoch for the current rank and size."""
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def state_dict(self) -> Dict[str, int]:
        """``{'epoch': epoch, 'processed_num': processed_num}``."""
        return dict(epoch=self.epoch, processed_num=self.processed_num)

    def reset(self) -> None:
        """Re-partitions the unprocessed rest of the epoch for the job's current rank and size
        (called after every reset of the job)."""
        self._set_world(size(), rank())

    def _set_world(self, num_replicas: int, rank: int) -> None:
        """The partition for ``rank`` of ``num_replicas``: the body of :meth:`reset`, with the
        world given instead of read from the job, so that tests can compute the partition of
        any world size in one process. Not part of Horovod's API."""
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in a world of {num_replicas} replicas")
        self.num_replicas = num_replicas
        self.rank = rank

        all_indices = list(range(len(self.dataset)))
        if self.shuffle:
            # The same permutation on every rank and at every size: the processed prefix of an
            # epoch is the same samples whatever the world was when they were processed.
            random.Random(self.seed + self.epoch).shuffle(all_indices)
        self.remaining_indices = all_indices[self.processed_num :]

        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)  # ceil
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self.indices = self.remaining_indices[:]

        # Pad with the first indices again, so that every rank gets num_samples of them. Cycled,
        # for a rest shorter than the padding it needs (Horovod's single slice then fails its
        # length assertion); otherwise the same padding as Horovod's.
        padding = self.total_size - len(self.indices)
        if padding > 0:
            repeats = -(-padding // len(self.indices))
            self.indices += (self.indices * repeats)[:padding]
        assert len(self.indices) == self.total_size

        # Round-robin: rank r takes positions r, r + num_replicas, ...
        self.indices = self.indices[self.rank : self.total_size : self.num_replicas]
        assert len(self.indices) == self.num_samples

        return iter(self.indices)

    def __len__(self) -> int:
        """The number of samples this rank has left in the epoch."""
        return self.num_samples
