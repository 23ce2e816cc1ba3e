"""``hvd.DistributedOptimizer`` (``horovod.torch.optimizer``): gradient averaging with buckets.

Semantics are Horovod's (names, defaults, messages, hooks, ``synchronize``/``skip_synchronize``,
``backward_passes_per_step``, ``groups``, sparse gradients). What differs is how gradients travel:
in buckets, reduced in place while backward still runs (``torch/buckets.py``), and the update
may run bucket by bucket (``torch/bucketwise.py``). ``algorithm=`` runs one of BAGUA's
algorithms at the points of the step (``torch/algorithms.py``). ``op=Adasum`` with more than one
rank is Horovod's delta optimizer (``torch/adasum.py``).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

import bagua_hvd.torch.algorithms as _alg
import bagua_hvd.torch.bucketwise as bucketwise
import bagua_hvd.torch.hooks as _hooks
import bagua_hvd.torch.mpi_ops as mpi_ops
from bagua_hvd.common import algorithms as _alg_common
from bagua_hvd.common import autotune, config
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.basics import after_init as basics_after_init
from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.common.util import check_predivide_and_groups
from bagua_hvd.torch.adasum import _DistributedAdasumOptimizer
from bagua_hvd.torch.buckets import Bucket, Buckets
from bagua_hvd.torch.compression import Compression
from bagua_hvd.torch.mpi_ops import Adasum, Average, rocm_built, size

__all__ = ["DistributedOptimizer"]

# The state dict's entry of Auto's choice.
_AUTO_STATE = "bagua_hvd_auto"

_STEP_AFTER_SYNC_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


class _DistributedOptimizer(torch.optim.Optimizer):
    # Methods are copied into a class derived from the wrapped optimizer's class (Horovod's
    # construction); ``_hvd_cls`` is that class, so ``super(self._hvd_cls, self)`` is the
    # wrapped class even if users subclass the result.
    _hvd_cls: type

    def __init__(
        self,
        params: Any,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int = 1,
        op: int = Average,
        gradient_predivide_factor: float = 1.0,
        groups: Any = None,
        sparse_as_dense: bool = False,
        process_set: ProcessSet = global_process_set,
        algorithm: Any = None,
    ) -> None:
        super(self._hvd_cls, self).__init__(params)
        self._algorithm = algorithm
        self._algo_impl: Any = None
        if algorithm is not None:
            algorithm.prepare_optimizer(self)  # e.g. QAdam: the stage of its optimizer
        _hooks.init_hook_state(self, named_parameters, compression, backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = _checked_groups(groups)

        if op == Average:
            # Average = Sum, then the core divides the postscale factor by size().
            self._prescale = 1.0 / gradient_predivide_factor
            self._postscale = gradient_predivide_factor
        else:
            self._prescale = 1.0
            self._postscale = 1.0

        # The buckets, with the hooks (none at one rank outside an elastic job).
        self._bucketing: Optional[Buckets] = None
        self._bucket_cap = config.bucket_bytes()
        # Steps whose update ran bucket by bucket, and the update calls they made (tests).
        self._bucketwise_steps = self._bucketwise_updates = 0

        # Horovod's autotuner tunes the bucket size of an optimizer of the global set whose
        # buckets are cut by size (not by ``groups``); rank 0 decides, every rank follows at the
        # same step (_agree_bucket_cap).
        self._tunes_buckets = False
        if self.process_set.included() and (size() > 1 or config.elastic()):
            if algorithm is not None:
                self._algo_impl = _alg.implementation(algorithm, self, self._parameter_names)
            self._register_hooks()
            _LIVE.add(self)
            if self._groups is None and self.process_set.process_set_id == 0:
                self._tunes_buckets = autotune.tunes_buckets()
                if self._tunes_buckets:
                    autotune.use_buckets()

    @property
    def _buckets(self) -> List[Bucket]:
        return [] if self._bucketing is None else self._bucketing.buckets

    def _register_hooks(self) -> None:
        p_list = [
            p for param_group in self.param_groups for p in param_group["params"] if p.requires_grad
        ]
        self._bucketing = Buckets(
            p_list,
            self._parameter_names,
            self._handles,
            self._allreduce_delay,
            self.process_set,
            (self.op, self._prescale, self._postscale),
            self._compression,
            self.sparse_as_dense,
            self._groups,
            self._bucket_cap,
            self._algo_impl,
        )
        self._requires_update.update(p_list)
        # The hook is the buckets' own method, no call in between (docs/design-core.md).
        _hooks.register_grad_hooks(self, p_list, self._bucketing.ready)

    def _plan_again(self) -> None:
        """A new job was formed (an elastic reset): agree on the bucket layout (and an
        algorithm's step counts) again at the next step, as the workers that just joined do at
        their first; an algorithm drops what belonged to the old job (residuals, neighbours'
        replicas, its background averager)."""
        if self._bucketing is not None:
            self._bucketing.plan_again()
            if self._algo_impl is not None:
                self._algo_impl.replan()
        # The new job's tuner starts afresh (rank 0's, bagua_hvd.common.autotune).
        self._tunes_buckets = (
            self._bucketing is not None
            and self._groups is None
            and self.process_set.process_set_id == 0
            and autotune.tunes_buckets()
        )

    def _agree_bucket_cap(self) -> None:
        """While the autotuner tunes the bucket size: rank 0's current size, on every rank at
        the end of the same step; a new size plans the buckets again (at the next step, as after
        an elastic reset). The last broadcast says tuning is done."""
        cap, active = self._bucket_cap, True
        if self.process_set.rank() == 0:
            cap, active = autotune.rank0_bucket_state(self._bucket_cap)
        agreed = mpi_ops.broadcast(
            torch.tensor([cap, int(active)], dtype=torch.int64),
            0,
            name="DistributedOptimizer.autotune",
        )
        cap = int(agreed[0])
        if cap != self._bucket_cap:
            self._bucket_cap = self._bucketing.cap = cap
            self._bucketing.plan_again()
            if self._algo_impl is not None:
                self._algo_impl.replan()
        self._tunes_buckets = bool(agreed[1])

    # ---- Horovod's public surface --------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict; with ``algorithm=Auto``, also its choice
        (under ``"bagua_hvd_auto"``)."""
        state = super(self._hvd_cls, self).state_dict()
        schedule = getattr(self._algo_impl, "schedule", None)
        if schedule is not None:
            state[_AUTO_STATE] = schedule.state_dict()
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._handles.clear()
        self._synchronized = False
        self._should_synchronize = True
        self._reset_round()
        if self._bucketing is not None and self._bucketing.observed is not None:
            self._bucketing.observed = []
        auto = state_dict.get(_AUTO_STATE)
        if auto is not None:
            state_dict = {k: v for k, v in state_dict.items() if k != _AUTO_STATE}
        super(self._hvd_cls, self).load_state_dict(state_dict)
        schedule = getattr(self._algo_impl, "schedule", None)
        if auto is not None and schedule is not None:
            schedule.load_state_dict(auto)  # Auto's choice: kept, not measured again

    @staticmethod
    def find_duplicates(lst: Sequence[Any]) -> set:
        return _hooks.find_duplicates(lst)

    set_backward_passes_per_step = _hooks.set_backward_passes_per_step
    zero_grad = _hooks.zero_grad

    def synchronize(self) -> None:
        """Waits for every gradient's allreduce (starting those not started yet) and writes
        the averaged gradients to ``p.grad``."""
        if not self.process_set.included():
            self._synchronized = True
            return
        impl = self._algo_impl
        if impl is not None and not impl.communicates_gradients():
            impl.synchronize()  # weight algorithms: gradients stay local
            self._handles.clear()
            self._synchronized = True
            return
        buckets = self._bucketing
        if buckets is not None:
            buckets.launch_missing()
            self._wait_all()
            if not buckets.layout_final:
                buckets.finalize()
        self._handles.clear()
        self._synchronized = True

    def _wait_all(self, bucket_done: Optional[Callable[[Bucket], None]] = None) -> None:
        """Waits for every reduction in launch order (each writes its result to the
        gradients); ``bucket_done(b)`` after each bucket's."""
        for key, pending in self._handles.items():
            pending.wait()
            if bucket_done is not None and type(key) is Bucket:
                bucket_done(key)
        self._reset_round()

    def _reset_round(self) -> None:
        bpps = self.backward_passes_per_step
        delay = self._allreduce_delay
        for p in delay:
            delay[p] = bpps
        if self._bucketing is not None:
            self._bucketing.reset_round()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """A context manager used to specify that optimizer.step() should not perform
        synchronization.

        It's typically used in a following pattern::

            optimizer.synchronize()
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_AFTER_SYNC_WARNING, stacklevel=2)
            elif bucketwise.applies(self, closure):
                self._synchronize_and_update_bucketwise()
                if self._algo_impl is not None:
                    self._algo_impl.after_step()
                if self._tunes_buckets:
                    self._agree_bucket_cap()
                return None
            self.synchronize()
        self._synchronized = False
        result = super(self._hvd_cls, self).step(closure)
        if self._algo_impl is not None:
            self._algo_impl.after_step()
        if self._tunes_buckets:
            self._agree_bucket_cap()
        return result

    def _synchronize_and_update_bucketwise(self) -> None:
        """synchronize() and the wrapped optimizer's update, interleaved: after each bucket's
        wait, the update of its parameters; then the update of every other parameter. The same
        waits, in the same order, as synchronize()."""
        self._bucketing.launch_missing()
        update = bucketwise.Update(self)
        with torch.autograd.profiler.record_function(f"Optimizer.step#{update.base.__name__}.step"):
            try:
                self._wait_all(update.bucket_done)
            finally:
                self._handles.clear()
            update.rest()
        self._bucketwise_steps += 1
        self._synchronized = False


# torch.optim.Optimizer wraps ``step`` of each class once with its profiling and step hooks; the
# wrapped class's step (called through super()) already has them, so ours must not run them
# a second time (and costs nothing at one rank).
_DistributedOptimizer.step.hooked = True  # type: ignore[attr-defined]


# Optimizers with hooks; each plans its layout again after an init that formed a new job.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _plan_all_again() -> None:
    for opt in list(_LIVE):
        opt._plan_again()


basics_after_init(_plan_all_again)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _checked_groups(groups: Any) -> Any:
    """Horovod's checks of ``groups`` (a positive number, or lists of distinct tensors)."""
    if groups is not None:
        if not (isinstance(groups, list) or (_is_int(groups) and groups > 0)):
            raise ValueError(
                "groups should be a non-negative integer or a list of list of torch.Tensor."
            )
        if isinstance(groups, list):
            grouped_parameter_ids = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor.")
                    if id(p) in grouped_parameter_ids:
                        raise ValueError("A parameter can only appear once in groups.")
                    grouped_parameter_ids.add(id(p))
    return groups


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    algorithm: Any = None,
) -> torch.optim.Optimizer:
    """An optimizer that wraps another torch.optim.Optimizer, using an allreduce to combine
    gradient values before applying gradients to model weights.

    Allreduce operations are executed after each gradient is computed by ``loss.backward()``
    in parallel with each other. The ``step()`` method ensures that all allreduce operations
    are finished before applying gradients to the model.

    DistributedOptimizer exposes the ``synchronize()`` method, which forces allreduce
    operations to finish before continuing the execution. It's useful in conjunction with
    gradient clipping, or other operations that modify gradients in place before ``step()`` is
    executed. Make sure to use ``optimizer.skip_synchronize()`` if you're calling
    ``synchronize()`` in your code.

    Example of gradient clipping::

        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        with optimizer.skip_synchronize():
            optimizer.step()

    Arguments:
        optimizer: Optimizer to use for computing gradients and applying updates.
        named_parameters: A mapping between parameter names and values. Used for naming of
            allreduce operations. Typically just ``model.named_parameters()``. Default: None
            (names ``allreduce.noname.<group>.<index>``).
        compression: Compression algorithm used during allreduce to reduce the amount of data
            sent during each parameter update step. Defaults to ``Compression.none``
            (``Compression.fp16``, ``Compression.bf16`` or a ``Compressor`` subclass).
        backward_passes_per_step: Number of expected backward passes to perform before calling
            ``step()``/``synchronize()``. This allows accumulating gradients over multiple
            mini-batches before reducing and applying them. Default: 1.
        op: The reduction operation to use when combining gradients across different ranks.
            Default: ``Average``. ``Adasum`` with more than one rank: Horovod's delta optimizer
            (each rank's update, combined with Adasum; ``bagua_hvd.torch.adasum``).
        gradient_predivide_factor: If op == Average, gradient_predivide_factor splits the
            averaging before and after the sum. Gradients are scaled by
            1.0 / gradient_predivide_factor before the sum and gradient_predivide_factor /
            size after the sum. Default: 1.0.
        num_groups: Number of groups to assign gradient allreduce ops to for explicit grouping.
            Deprecated, use ``groups``. Default: 0.
        groups: The parameter to group the gradient allreduce ops. Accepts values is a
            non-negative integer or a list of list of torch.Tensor. If groups is a non-negative
            integer, it is the number of groups to assign gradient allreduce ops to for explicit
            grouping. If groups is a list of list of torch.Tensor, tensors in the same inner
            list will be assigned to the same group, while parameters that do not appear in any
            list form groups of their own. Groups replace the size-based buckets
            (``BAGUA_HVD_BUCKET_MB``). Default: None.
        sparse_as_dense: If set True, convert all sparse gradients to dense and perform
            allreduce, then convert back to sparse before applying the update. Default: False
            (sparse gradients go through ``sparse_allreduce_async``).
        process_set: Gradients will only be reduced over Horovod processes belonging to this
            process set. Defaults to the global process set.
        algorithm: One of BAGUA's algorithms from ``bagua_hvd.torch.algorithms``
            (``GradientAllReduce``, ``ByteGrad``, ``Decentralized``, ``LowPrecisionDecentralized``,
            ``QAdamAlgorithm``, ``AsyncModelAverage``; docs/algorithms.md), or ``"auto"`` /
            ``Auto([...])``: the fastest of some candidates, measured during the first steps
            (docs/algorithms.md, "Auto"). Default: None, which
            takes ``BAGUA_HVD_ALGORITHM`` (``bagua-run --algorithm``) if set, else Horovod's
            gradient allreduce configured by the arguments above.

    Environment: ``BAGUA_HVD_BUCKET_MB`` (default 10, BAGUA's bucket size) caps the
    size of a bucket of gradients sent as one allreduce; 0 sends one allreduce per parameter.

    Returns an instance of a class derived from ``optimizer``'s class, with the same name.
    """
    # We dynamically create a new class that inherits from the optimizer that was passed in.
    # The goal is to override the `step()` method with an allreduce implementation.
    groups = check_predivide_and_groups(
        op, gradient_predivide_factor, num_groups, groups, rocm_built(), stacklevel=3
    )

    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")

    adasum = op == Adasum and size() > 1
    algorithm, op = _alg_common.resolve(
        algorithm, frontend="torch", op=op, compression=compression, groups=groups,
        optimizer=optimizer, qadam_optimizer_class=lambda: _alg.QAdamOptimizer,
    )  # fmt: skip
    if adasum:
        if _ops.process_set_id(process_set) != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        cls = type(
            optimizer.__class__.__name__,
            (optimizer.__class__,),
            dict(_DistributedAdasumOptimizer.__dict__),
        )
        cls._hvd_cls = cls
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)

    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_DistributedOptimizer.__dict__),
    )
    cls._hvd_cls = cls
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
        algorithm,
    )
