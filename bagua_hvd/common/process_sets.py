"""Process sets (``horovod.common.process_sets``): subsets of ranks that run collectives alone.

Static sets are passed to ``init(process_sets=[...])`` and get ids 1..k in the order given;
dynamic sets are added and removed collectively after ``init`` when
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``init(process_sets="dynamic")``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Union

from bagua_hvd.common import _native
from bagua_hvd.common.exceptions import NOT_INITIALIZED_ERROR


class ProcessSet:
    """A set of global ranks; registered sets have a ``process_set_id`` (0 is the global set).

    ``ranks_or_comm`` is a sequence of global ranks (stored sorted) or an mpi4py communicator
    (its ranks are found at ``hvd.init(comm=<global communicator>, process_sets=[...])``, as
    Horovod does: each rank's communicator may differ, e.g. after ``Split``, and every distinct
    one becomes a set).
    """

    process_set_id: int | None = None
    ranks: List[int] | None = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Any) -> None:
        self.ranks, self.mpi_comm = None, None
        if type(ranks_or_comm).__module__.startswith("mpi4py"):
            self.mpi_comm = ranks_or_comm
            return
        if not hasattr(ranks_or_comm, "__iter__"):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py "
                "Comm object"
            )
        ranks = []
        for r in ranks_or_comm:
            if isinstance(r, bool) or not isinstance(r, int) and not hasattr(r, "__index__"):
                raise ValueError(f"ProcessSet ranks must be integers, got {r!r}")
            ranks.append(int(r))
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> int | None:
        """Number of ranks in the set; None if the set is not registered."""
        if self.process_set_id is None:
            return None
        return _process_set_size(self.process_set_id)

    def rank(self) -> int | None:
        """This process's rank within the set; None if the set is not registered.

        Raises ValueError if this process is not a member.
        """
        if self.process_set_id is None:
            return None
        return _process_set_rank(self.process_set_id)

    def included(self) -> bool | None:
        """Whether this process belongs to the set; None if the set is not registered."""
        if self.process_set_id is None:
            return None
        return _process_set_included(self.process_set_id)

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# Registered ProcessSet objects by id (the global set included); kept in sync by basics.init,
# add_process_set and remove_process_set.
_id_to_process_sets: Dict[int, ProcessSet] = {0: global_process_set}
# What init() passed to the core: whether sets may be added/removed after init.
_dynamic_enabled = False

# Horovod's message (horovod/common/basics.py) for a process set id the core does not know.
UNKNOWN_SET_ERROR = "Process set does not exist or has not been registered."


def _require_init() -> None:
    if not _native.lib().bhvd_is_initialized():
        raise ValueError(NOT_INITIALIZED_ERROR)


def _process_set_size(process_set_id: int) -> int:
    _require_init()
    n = _native.lib().bhvd_process_set_ranks(process_set_id, _native.ffi.NULL, 0)
    if n < 0:
        raise ValueError(UNKNOWN_SET_ERROR)
    return int(n)


def _process_set_rank(process_set_id: int) -> int:
    _require_init()
    r = _native.lib().bhvd_process_set_rank(process_set_id)
    if r == -2:
        raise ValueError(UNKNOWN_SET_ERROR)
    if r == -1:
        raise ValueError("Process is not part of provided process set.")
    return int(r)


def _process_set_included(process_set_id: int) -> bool:
    _require_init()
    r = _native.lib().bhvd_process_set_rank(process_set_id)
    if r == -2:
        raise ValueError(UNKNOWN_SET_ERROR)
    return r >= 0


def _core_process_sets() -> Dict[int, List[int]]:
    """The sets the core has registered now: id -> sorted global ranks."""
    lib, ffi = _native.lib(), _native.ffi
    count = lib.bhvd_process_set_ids(ffi.NULL, 0)
    if count < 0:
        raise ValueError(NOT_INITIALIZED_ERROR)
    ids = ffi.new("int32_t[]", max(count, 1))
    count = min(count, lib.bhvd_process_set_ids(ids, count))
    size = max(lib.bhvd_size(), 1)
    buf = ffi.new("int32_t[]", size)
    out: Dict[int, List[int]] = {}
    for i in range(count):
        n = lib.bhvd_process_set_ranks(ids[i], buf, size)
        if n >= 0:
            out[int(ids[i])] = sorted(int(buf[j]) for j in range(n))
    return out


def _after_init(dynamic: bool) -> None:
    """The runtime started: the global set's ranks, and whether sets may change later."""
    global _dynamic_enabled
    _dynamic_enabled = dynamic
    _id_to_process_sets.clear()
    global_process_set.ranks = _core_process_sets().get(0, [])
    global_process_set.process_set_id = 0
    _id_to_process_sets[0] = global_process_set


def _init_process_sets(process_sets: Sequence[ProcessSet]) -> None:
    """Gives the ProcessSet objects passed to init() the ids of the registered sets with their
    ranks (Horovod's _init_process_sets): a set whose id an earlier entry (or the global set)
    already has is invalidated, and init() raises Horovod's duplicate error for it."""
    by_ranks: Dict[tuple, int] = {}
    for i, r in sorted(_core_process_sets().items()):
        by_ranks.setdefault(tuple(r), i)
    seen = {0}
    duplicate = None
    for ps_idx, ps in enumerate(process_sets):
        ps_id = by_ranks.get(tuple(ps.ranks or ()))
        if ps_id is None:
            raise ValueError(
                f"process_sets entry number {ps_idx} ({ps}) was not registered when Horovod "
                "was initialized; register it with hvd.add_process_set() "
                "(HOROVOD_DYNAMIC_PROCESS_SETS=1)"
            )
        if ps_id in seen:  # the other entries still get their ids, as Horovod's
            ps._invalidate()
            duplicate = (ps_idx, ps) if duplicate is None else duplicate
            continue
        seen.add(ps_id)
        ps.process_set_id = ps_id
        _id_to_process_sets[ps_id] = ps
    if duplicate is not None:
        raise ValueError(
            f"Horovod could not be initialized because process_sets entry number {duplicate[0]} "
            f"is a duplicate: {duplicate[1]}"
        )


def _after_shutdown() -> None:
    """Registered sets lose their ids: they refer to a runtime that no longer exists."""
    for ps_id, ps in list(_id_to_process_sets.items()):
        if ps_id != 0:
            ps._invalidate()
    _id_to_process_sets.clear()
    _id_to_process_sets[0] = global_process_set


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Registers a new process set; a collective that every rank must call with the same ranks.

    Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``init(process_sets="dynamic")``). Returns the
    registered ProcessSet (the argument itself if it was one).
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    _require_init()
    if not _dynamic_enabled:
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod "
            "initialization."
        )
    if process_set.ranks is None:
        raise ValueError(
            "add_process_set: a ProcessSet of an MPI communicator is registered by hvd.init("
            "comm=..., process_sets=[...]); pass the list of global ranks here"
        )
    ranks = process_set.ranks
    if process_set.process_set_id is not None or any(
        r == ranks for r in _core_process_sets().values()
    ):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    lib, ffi = _native.lib(), _native.ffi
    id_out = ffi.new("int32_t *")
    status = lib.bhvd_add_process_set(ffi.new("int32_t[]", ranks), len(ranks), id_out)
    _raise_for_status(status, "add_process_set")
    process_set.process_set_id = int(id_out[0])
    _id_to_process_sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Deregisters a process set (a collective over all ranks); the object is invalidated.

    Returns False for an unregistered set or the global set, True once removed.
    """
    process_set_id = process_set.process_set_id
    if process_set_id is None or process_set_id == 0:
        return False
    _require_init()
    if not _dynamic_enabled:
        raise ValueError(
            "Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod "
            "initialization."
        )
    status = _native.lib().bhvd_remove_process_set(process_set_id)
    if status != 0 and _native.lib().bhvd_process_set_rank(process_set_id) == -2:
        # Unknown to the core (already removed elsewhere): nothing left to remove.
        process_set._invalidate()
        _id_to_process_sets.pop(process_set_id, None)
        return False
    _raise_for_status(status, "remove_process_set")
    process_set._invalidate()
    _id_to_process_sets.pop(process_set_id, None)
    return True


def _raise_for_status(status: int, what: str) -> None:
    if status == 0:
        return
    from bagua_hvd.common.ops import exception_for_status

    raise exception_for_status(status, f"{what}: {_native.last_error()}")
