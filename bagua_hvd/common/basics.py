"""HorovodBasics: init/shutdown, rank and size queries and build facts, shared by all frontends.

All frontends talk to the same core library, so the state lives in the core and in
``process_sets``; HorovodBasics instances are thin views and several may coexist.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import warnings
from typing import Any, Callable, Dict, List, Sequence, Union

from bagua_hvd.common import _native, autotune, bootstrap, config, elastic, ops
from bagua_hvd.common import process_sets as _ps
from bagua_hvd.common.exceptions import NOT_INITIALIZED_ERROR
from bagua_hvd.common.process_sets import ProcessSet

INIT_FAILED_ERROR = (
    "Horovod initialization failed. Please check log messages above for a more descriptive error."
)
MPI_NOT_ENABLED_ERROR = "Horovod MPI is not enabled; Please make sure it's installed and enabled."
TIMELINE_NOT_DYNAMIC_ERROR = "Set HOROVOD_TIMELINE=DYNAMIC to enable dynamic timeline usage."

# Reduce ops (Horovod's C enum values).
Average = ops.Average
Sum = ops.Sum
Adasum = ops.Adasum
Min = ops.Min
Max = ops.Max
Product = ops.Product

_atexit_lock = threading.Lock()
_atexit_registered = False
# Called by shutdown() (hvd.shutdown() or at exit) before the core stops: work an algorithm left
# running in the background (a low-precision ring exchange) completes first, on every rank.
_before_shutdown: list = []


def before_shutdown(fn: Callable[[], None]) -> None:
    """Runs ``fn()`` at every shutdown while the job is still up (registered once per ``fn``)."""
    if fn not in _before_shutdown:
        _before_shutdown.append(fn)


# Called after every init() that formed a job: what planned for the previous job (a
# DistributedOptimizer's bucket layout, agreed with its peers) plans again with the new one (an
# elastic reset brings new peers that have not planned yet).
_after_init: list = []


def nccl_wheel_library() -> str:
    """The libnccl.so.2 of an installed nvidia-nccl-cu12/-cu13 wheel (what CUDA builds of torch
    depend on), or ""."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return ""
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "lib", "libnccl.so.2")
        if os.path.exists(path):
            return path
    return ""


def after_init(fn: Callable[[], None]) -> None:
    """Runs ``fn()`` after every init() that formed a job (registered once per ``fn``)."""
    if fn not in _after_init:
        _after_init.append(fn)


_no_effect_warned = False


def _warn_no_effect() -> None:
    """The one warning per process naming the HOROVOD_* variables set that have no effect here
    (config.no_effect_warning); those bagua-run already warned about are left out."""
    global _no_effect_warned
    if _no_effect_warned:
        return
    _no_effect_warned = True
    text = config.no_effect_warning()
    if text is not None:
        warnings.warn(text, UserWarning, stacklevel=4)


def _env_true(name: str) -> bool:
    return config.flag(name)


def _ranks_of_mpi_comm(comm: Any, subset: bool = False, base: Any = None) -> list[int]:
    """The ranks in ``base`` (default MPI_COMM_WORLD) of an mpi4py communicator given to
    init(comm=...), or of a ProcessSet's communicator (``subset``: sorted; ``base``: the job's
    global communicator)."""
    try:
        from mpi4py import MPI
    except ImportError:
        MPI = None
    if MPI is None or not isinstance(comm, MPI.Comm):
        raise ValueError(
            f"init(comm={type(comm).__name__}): comm must be a list of ranks or an mpi4py "
            "communicator"
        )
    world = (MPI.COMM_WORLD if base is None else base).Get_group()
    ranks = list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world))
    return sorted(ranks) if subset else ranks


def _sets_to_register(
    mpi_comm: Any, via_comm: Sequence[ProcessSet], process_sets: Sequence[ProcessSet]
) -> List[List[int]]:
    """The static sets the core registers at init, as Horovod's horovod_init_multi_comm: for
    each set of an MPI communicator, every rank's communicator's ranks (gathered over
    ``mpi_comm``; each rank may hold a different one), distinct ones in sorted order; then the
    sets of ranks in the order given. The global set and repeats are left out (a repeat gets
    the earlier id; init then reports the entry as a duplicate)."""
    out: List[List[int]] = []
    for ps in via_comm:
        mine = _ranks_of_mpi_comm(ps.mpi_comm, subset=True, base=mpi_comm)
        if any(r < 0 for r in mine):  # MPI.UNDEFINED: a rank outside the global communicator
            raise ValueError(
                f"Group of processes in process set {ps} is not a subset of the assumed global "
                "communicator."
            )
        out += sorted({tuple(r) for r in mpi_comm.allgather(mine)})
    out += [tuple(ps.ranks) for ps in process_sets if ps.ranks is not None]
    everyone = tuple(range(mpi_comm.Get_size())) if mpi_comm is not None else None
    unique: List[List[int]] = []
    for ranks in out:
        if list(ranks) not in unique and ranks != everyone:
            unique.append(list(ranks))
    return unique


class HorovodBasics:
    """Horovod's basics API (``horovod.common.basics.HorovodBasics``) over the bagua_hvd core.

    ``pkg_path`` and ``*args`` are accepted for compatibility with Horovod's constructor and
    ignored: there is one framework-neutral core library.
    """

    Average = Average
    Sum = Sum
    Adasum = Adasum
    Min = Min
    Max = Max
    Product = Product

    def __init__(self, pkg_path: str | None = None, *args: Any) -> None:
        self._lib = None

    @property
    def lib(self) -> Any:
        if self._lib is None:
            self._lib = _native.lib()
        return self._lib

    # ---- lifecycle -----------------------------------------------------------------------
    def init(
        self,
        comm: Sequence[int] | None = None,
        process_sets: Union[Sequence[ProcessSet], str] | None = None,
    ) -> None:
        """Starts the runtime (a no-op when already initialized).

        comm: None (every launched rank), a list of MPI_COMM_WORLD ranks, or an mpi4py
            communicator. As Horovod, under mpirun the job runs on those ranks only: job
            rank i is the list's i-th rank (the communicator's rank i); the other ranks are
            not part of it and do not call init() with that comm (a list that leaves out the
            caller raises ValueError). Under bagua-run, comm must name every launched rank.
        process_sets: static ProcessSet objects, or "dynamic" to allow
            add_process_set/remove_process_set after init (HOROVOD_DYNAMIC_PROCESS_SETS=1).
            As Horovod: sets of MPI communicators (with comm an MPI communicator) are
            registered first, every distinct one in the order of their sorted ranks, then the
            sets of ranks in the order given (ids 1, 2, ...); a set whose ranks an earlier
            entry or the global set has raises ValueError after the runtime started, which
            then stays up, and a later init() maps its list onto the sets registered then.
        """
        global _atexit_registered
        with _atexit_lock:
            if not _atexit_registered:
                atexit.register(self.shutdown)
                _atexit_registered = True
        mpi_comm = None
        if comm is not None and not isinstance(comm, (list, tuple, range)):
            mpi_comm, comm = comm, _ranks_of_mpi_comm(comm)
        if process_sets == "dynamic":
            process_sets = []
            config.set_dynamic_process_sets()
        elif process_sets is None:
            process_sets = []
        elif isinstance(process_sets, str):
            raise ValueError(
                f'process_sets must be a list of ProcessSet or "dynamic", got {process_sets!r}'
            )
        process_sets = list(process_sets)
        for ps_idx, ps in enumerate(process_sets):
            if not isinstance(ps, ProcessSet):
                raise ValueError(f"process_sets entry number {ps_idx} is not a ProcessSet: {ps!r}")
        via_comm = [ps for ps in process_sets if ps.ranks is None and ps.mpi_comm is not None]
        if via_comm and mpi_comm is None:
            raise NotImplementedError(
                "At this time process sets defined via MPI communicators are only supported "
                "when calling hvd.init() with comm set to a global MPI communicator."
            )

        if not self.lib.bhvd_is_initialized():
            self._start(
                comm,
                _sets_to_register(mpi_comm, via_comm, process_sets),
                mpi_comm if mpi_comm is not None else comm,
            )
        if mpi_comm is not None:
            _ps.global_process_set.mpi_comm = mpi_comm
        for ps in via_comm:
            ps.ranks = _ranks_of_mpi_comm(ps.mpi_comm, subset=True, base=mpi_comm)
        _ps._init_process_sets(process_sets)

    def _start(self, comm: Sequence[int] | None, sets: List[List[int]], job: Any = None) -> None:
        """Starts the core with the static sets ``sets`` (ids 1, 2, ... in that order);
        ``job``: init()'s comm (an mpi4py communicator or a list of ranks)."""
        lib = self.lib
        _warn_no_effect()
        autotune.check()  # on every rank, before a job forms: all fail alike
        elastic.before_init()  # an elastic reset: this worker's place in the next generation
        # Started by mpirun/srun rather than bagua-run: join through MPI, over init()'s comm.
        on_comm = bootstrap.prepare(job)
        # The global set's ranks are that set (id 0), not a new one (Horovod's FindId); without
        # a launcher's variables the job has one rank.
        size = config.launcher_size() or 1
        sets = [s for s in sets if s != list(range(size))]
        dynamic = _env_true("HOROVOD_DYNAMIC_PROCESS_SETS")
        self._load_nccl()  # before the core's first CUDA tensor, which uses the NCCL loaded
        ffi = _native.ffi
        flat = [r for ranks in sets for r in ranks]
        sizes = [len(ranks) for ranks in sets]
        status = lib.bhvd_init(
            ffi.new("int32_t[]", flat or [0]),
            ffi.new("int32_t[]", sizes or [0]),
            len(sets),
            1 if dynamic else 0,
        )
        if status != ops.OK:
            detail = _native.last_error()
            if detail:
                print(f"bagua_hvd: init failed: {detail}", file=sys.stderr, flush=True)
            raise ValueError(INIT_FAILED_ERROR + (f"\n{detail}" if detail else ""))
        elastic.after_init()
        try:
            _ps._after_init(dynamic)
            for fn in list(_after_init):
                fn()
            # Horovod's autotuner, on rank 0; the hierarchical allreduce is a tunable where the
            # job spans hosts and some host has several ranks.
            hosts = self.cross_size()
            autotune.start(self.rank(), hosts > 1 and self.size() != hosts)
            if (
                not on_comm
                and comm is not None
                and sorted(int(r) for r in comm) != list(range(self.size()))
            ):
                raise ValueError(
                    f"init(comm={list(comm)}): a job on a part of the launched ranks needs "
                    "mpirun (the job is then formed over those ranks through MPI); under "
                    "bagua-run every launched rank is in the job. Use "
                    "init(process_sets=[ProcessSet(ranks)]) instead"
                )
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stops the runtime; pending operations fail with HorovodInternalError."""
        if _native._lib is None and self._lib is None:
            return  # never loaded: nothing to stop (e.g. at exit)
        lib = self.lib
        if lib.bhvd_is_initialized():
            for fn in list(_before_shutdown):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - the shutdown itself must go on
                    warnings.warn(f"bagua_hvd: before shutdown: {e}", RuntimeWarning, stacklevel=2)
            status = lib.bhvd_shutdown()
            autotune.stop()  # its thread returns once the core stopped
            if status != ops.OK:
                raise RuntimeError(f"Horovod shutdown failed: {_native.last_error()}")
        _ps._after_shutdown()

    def is_initialized(self) -> bool:
        """True between a successful init() and shutdown()."""
        return bool(self.lib.bhvd_is_initialized())

    # ---- ranks and sizes -----------------------------------------------------------------
    def _checked(self, value: int) -> int:
        if value < 0:
            raise ValueError(NOT_INITIALIZED_ERROR)
        return int(value)

    def size(self) -> int:
        """Number of ranks in the job."""
        return self._checked(self.lib.bhvd_size())

    def local_size(self) -> int:
        """Number of ranks on this host."""
        return self._checked(self.lib.bhvd_local_size())

    def cross_size(self) -> int:
        """Number of hosts that have a rank with this process's local rank."""
        return self._checked(self.lib.bhvd_cross_size())

    def rank(self) -> int:
        """This process's global rank."""
        return self._checked(self.lib.bhvd_rank())

    def local_rank(self) -> int:
        """This process's rank on its host."""
        return self._checked(self.lib.bhvd_local_rank())

    def cross_rank(self) -> int:
        """This process's host index among hosts with the same local rank."""
        return self._checked(self.lib.bhvd_cross_rank())

    def is_homogeneous(self) -> bool:
        """True when every host runs the same number of ranks."""
        return bool(self._checked(self.lib.bhvd_is_homogeneous()))

    # ---- bytes on the wire ----------------------------------------------------------------
    def communication_stats(self) -> Dict[str, Dict[str, int]]:
        """The bytes this rank sent to other ranks since ``init()``, per op type:
        ``{op_type: {"within_host_bytes_sent": int, "between_hosts_bytes_sent": int,
        "calls": int}}``.

        - op type: the snake_case name of the core's op type ("allreduce", "allgather",
          "broadcast", "alltoall", "reducescatter", "adasum" (an allreduce with ``op=Adasum``),
          "hierarchical_allreduce", "compressed_allreduce" (ByteGrad), "peer_average",
          "lp_decentralized_init", "lp_decentralized_step", "lp_decentralized_exchange"), or
          "other" for bytes sent outside any op. Only op types with a call or a byte counted
          since ``init()`` appear.
        - ``within_host_bytes_sent``: payload bytes sent to ranks with this rank's
          ``HOROVOD_HOSTNAME`` (shared memory, or TCP with ``BAGUA_HVD_TRANSPORT=tcp``).
        - ``between_hosts_bytes_sent``: payload bytes sent to ranks on other hosts.
        - ``calls``: responses of that type this rank executed (fused tensors count once).

        Counted: every payload byte of a collective, at the transport that sends it (compressed
        bytes for ByteGrad, each hop of a hierarchical algorithm). Not counted: negotiation and
        other control messages (barrier and join included), bytes a rank keeps, and the
        collectives of ``HOROVOD_CPU_OPERATIONS=mpi``. NCCL's on CUDA tensors are counted by
        the ring model (docs/gpu.md): sends exactly, a collective's bytes as a ring's (an
        allreduce of S bytes over n ranks: 2S(n-1)/n) to the set's next rank. Raises
        ``ValueError`` before ``init()``.
        """
        ffi = _native.ffi
        n = ffi.new("int32_t *")
        cap = 16  # every op type of the core fits
        while True:
            out = ffi.new("bhvd_comm_stat[]", cap)
            status = self.lib.bhvd_communication_stats(out, cap, n)
            if status == ops.NOT_INITIALIZED:
                raise ValueError(NOT_INITIALIZED_ERROR)
            if status != ops.OK:
                raise RuntimeError(_native.last_error())
            if n[0] <= cap:
                break
            cap = n[0]  # a type counted its first byte meanwhile: ask again with room for all
        return {
            ffi.string(out[i].op_type).decode(): {
                "within_host_bytes_sent": int(out[i].within_host_bytes_sent),
                "between_hosts_bytes_sent": int(out[i].between_hosts_bytes_sent),
                "calls": int(out[i].calls),
            }
            for i in range(n[0])
        }

    # ---- timeline ------------------------------------------------------------------------
    def start_timeline(self, file_path: str, mark_cycles: bool = False) -> None:
        """Starts writing Horovod's timeline (a Chrome-trace JSON, written by rank 0) to
        ``file_path``, with a CYCLE_START marker per cycle when ``mark_cycles``. Needs
        ``HOROVOD_TIMELINE`` set at ``init()`` (``DYNAMIC`` to start no file until now)."""
        self._timeline_status(
            self.lib.bhvd_start_timeline(os.fsencode(file_path), int(bool(mark_cycles)))
        )

    def stop_timeline(self) -> None:
        """Stops the timeline; the file is complete (valid JSON) when this returns. As Horovod,
        stopping a timeline that does not run does nothing; before ``init()`` it raises
        ``ValueError``."""
        self._timeline_status(self.lib.bhvd_stop_timeline())

    def _timeline_status(self, status: int) -> None:
        if status == ops.OK:
            return
        if status == ops.NOT_INITIALIZED:
            raise ValueError(NOT_INITIALIZED_ERROR)
        detail = _native.last_error()
        if status == ops.INVALID_ARGUMENT:
            raise ValueError(detail)
        raise RuntimeError(detail)

    # ---- build facts ---------------------------------------------------------------------
    def mpi_threads_supported(self) -> bool:
        """Whether the MPI the collectives run through provides MPI_THREAD_MULTIPLE; raises
        ValueError when MPI is not enabled (``HOROVOD_CPU_OPERATIONS=mpi`` under mpirun)."""
        supported = int(self.lib.bhvd_mpi_threads_supported())
        if supported < 0:
            raise ValueError(MPI_NOT_ENABLED_ERROR)
        return supported == 1

    def mpi_enabled(self) -> bool:
        """True when Horovod's collectives run through MPI: ``HOROVOD_CPU_OPERATIONS=mpi`` in a
        job that mpirun started (the controller stays bagua_hvd's own)."""
        return int(self.lib.bhvd_mpi_enabled()) == 1

    def mpi_built(self) -> bool:
        """True: MPI support is built in; the MPI library itself is the one the job runs
        (mpi4py's, loaded at run time)."""
        return True

    def gloo_enabled(self) -> bool:
        """True: the core plays the role of Horovod's Gloo controller and CPU operations."""
        return True

    def gloo_built(self) -> bool:
        """True: the core plays the role of Horovod's Gloo controller and CPU operations."""
        return True

    def _load_nccl(self) -> int:
        """Loads NCCL into a core built with CUDA (once per process): BAGUA_HVD_NCCL_LIBRARY,
        else the libnccl torch has loaded, else the nvidia-nccl wheel's, else libnccl.so.2."""
        if not self.lib.bhvd_cuda_built():
            return 0
        ffi = _native.ffi
        library = config.nccl_library()
        wheel = nccl_wheel_library()
        return int(
            self.lib.bhvd_nccl_load(
                library.encode() if library else ffi.NULL, wheel.encode() if wheel else ffi.NULL
            )
        )

    def nccl_built(self) -> int:
        """NCCL_VERSION_CODE of the NCCL that runs CUDA tensors' collectives (loaded at run
        time), or 0: a build without CUDA, or no NCCL found (CUDA tensors are then staged
        through host memory; docs/gpu.md)."""
        self._load_nccl()
        return int(self.lib.bhvd_nccl_built())

    def ddl_built(self) -> bool:
        """False: no IBM DDL support."""
        return False

    def ccl_built(self) -> bool:
        """False: no oneCCL support."""
        return False

    def cuda_built(self) -> bool:
        """Whether the core was built with CUDA support: collectives take CUDA tensors on the
        device (through NCCL, or staged through pinned host memory where NCCL cannot serve)."""
        return bool(self.lib.bhvd_cuda_built())

    def rocm_built(self) -> bool:
        """False: no ROCm support."""
        return False

    # ---- helpers Horovod's frontends use -------------------------------------------------
    def _process_set_size(self, process_set_id: int) -> int:
        return _ps._process_set_size(process_set_id)

    def _process_set_rank(self, process_set_id: int) -> int:
        return _ps._process_set_rank(process_set_id)

    def _process_set_included(self, process_set_id: int) -> bool:
        return _ps._process_set_included(process_set_id)

    def _get_process_set_ids_and_ranks(self) -> dict:
        return _ps._core_process_sets()
