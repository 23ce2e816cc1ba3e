"""``hvd.DistributedOptimizer`` (``horovod.torch.optimizer``): gradient averaging with buckets.

Semantics are Horovod's (names, defaults, messages, hooks, ``synchronize``/``skip_synchronize``,
``backward_passes_per_step``, ``groups``, sparse gradients). What differs is how gradients travel:

* **Buckets.** Gradients are fused into buckets of at most ``BAGUA_HVD_BUCKET_MB`` MiB (default
  10, BAGUA's default bucket size; fractions allowed; a bigger parameter gets a bucket of
  its own), one dtype and device per bucket, filled in the order gradients become ready:
  reverse registration order as the first guess, then the order observed during the first
  step (rank 0's, so that every rank builds the same buckets). One allreduce per bucket starts
  as soon as its last gradient is ready, while backward still runs. ``BAGUA_HVD_BUCKET_MB=0``
  sends one allreduce per parameter (Horovod's way, fused by the core within
  ``HOROVOD_CYCLE_TIME``). ``groups`` (Horovod's option) defines the buckets explicitly and
  overrides the size.
* **No copies in the core, no extra memory.** Each bucket owns one flat buffer and the
  parameters' ``.grad`` are views of it (like DDP's ``gradient_as_bucket_view=True``): the core
  reduces the buffer in place. Gradients accumulate straight into it when ``.grad`` is kept
  between steps (``zero_grad(set_to_none=False)``, ``backward_passes_per_step > 1``); after
  ``zero_grad()`` (``set_to_none=True``) autograd's new gradient is copied into its slot once,
  in the hook, and freed. Memory: one gradient-sized buffer, where DDP holds the gradients plus
  its bucket buffers. The core never copies a tensor of ``BAGUA_HVD_NO_FUSE_BYTES`` (1 MiB) or
  more into its fusion buffer, so full-size buckets are reduced in place; small buckets are
  fused, which is what fusion is for. ``Compression.fp16``/``bf16`` use one persistent low-precision buffer per
  bucket. Other ``Compressor`` classes compress each gradient separately (Horovod's semantics)
  and the bucket is sent as one grouped allreduce.
* A ``.grad`` tensor is reused from step to step (it is a view of the bucket): code that keeps a
  reference to last step's ``p.grad`` sees it overwritten by the next backward, as with DDP's
  ``gradient_as_bucket_view``. Code that assigns ``p.grad`` is fine (the hook copies it in).
* ``op=Adasum`` with more than one rank is Horovod's delta optimizer (``torch/adasum.py``).
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from bagua_hvd.common import algorithms as _alg_common
from bagua_hvd.common import config, engine
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.basics import after_init as basics_after_init
from bagua_hvd.common.primitives import Request
from bagua_hvd.common.process_sets import ProcessSet, global_process_set
from bagua_hvd.common.util import check_predivide_and_groups, split_list
from bagua_hvd.torch import mpi_ops
from bagua_hvd.torch.compression import (
    BF16Compressor,
    Compression,
    FP16Compressor,
    NoneCompressor,
)
from bagua_hvd.torch.mpi_ops import Adasum, Average, rocm_built, size

__all__ = ["DistributedOptimizer"]

_ZERO_GRAD_MESSAGE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_PASSES_MESSAGE = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_STEP_AFTER_SYNC_WARNING = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)
# mpi_ops.synchronize() of an unknown handle returns None: a bucket with nothing to send.
_NO_HANDLE = -1
# Optimizers whose update of a parameter reads that parameter's gradient and state only (with
# foreach or fused kernels too, which work tensor by tensor): updating the buckets one at a time
# gives the bits of one update of all. Exact classes: a subclass may override step().
_BUCKETWISE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# Optimizer classes whose step splits by parameters on its own terms (QAdamOptimizer: its step
# count and stage are the whole step's): begin(optimizer) starts a step and returns the update
# of a subset of param groups. Registered by the class's module (register_partial_step).
_PARTIAL_STEPS: Dict[type, Callable[[Any], Callable[[List[Dict[str, Any]]], None]]] = {}
# Buckets are updated together until they hold this many bytes of parameters: an update call
# costs tens of microseconds, which small buckets (BAGUA_HVD_BUCKET_MB=0) must not pay each.
_BUCKETWISE_MIN_BYTES = 1 << 20


def register_partial_step(
    cls: type, begin: Callable[[Any], Callable[[List[Dict[str, Any]]], None]]
) -> None:
    """Declares that ``cls``'s update of a parameter reads that parameter's gradient and state
    only, and how to run it by parts: ``begin(optimizer)`` starts one step and returns the
    update of the parameters of a subset of its param groups, called until each was updated
    once. step() then updates bucket by bucket, as for torch.optim.SGD."""
    _PARTIAL_STEPS[cls] = begin


def _global_step_hooks() -> bool:
    """Whether step hooks were registered for every optimizer (torch.optim.optimizer's
    register_optimizer_step_pre_hook / _post_hook)."""
    from torch.optim import optimizer as _torch_opt

    return bool(
        getattr(_torch_opt, "_global_optimizer_pre_hooks", None)
        or getattr(_torch_opt, "_global_optimizer_post_hooks", None)
    )


# Compressors that are element-wise casts: a whole bucket can be compressed at once.
_CAST_COMPRESSORS = {
    NoneCompressor: None,
    FP16Compressor: torch.float16,
    BF16Compressor: torch.bfloat16,
}


class _Bucket:
    """Parameters reduced together, in one of three forms: a flat buffer whose views are the
    gradients (``flat``), one parameter reduced in its own ``.grad`` (``direct``), or a grouped
    allreduce of the (compressed) gradients (neither: custom compressors, mixed dtypes)."""

    __slots__ = (
        "params",
        "name",
        "op",
        "prescale",
        "postscale",
        "flat",
        "views",
        "comp",
        "direct",
        "remaining",
        "sparse_dense",
        "dense_tmp",
        "skip",
        "residuals",
    )

    def __init__(self, params: List[torch.Tensor], name: str) -> None:
        self.params = params
        self.name = name
        self.op = Average
        self.prescale = 1.0
        self.postscale = 1.0
        self.flat: Optional[torch.Tensor] = None  # the flat gradient buffer
        self.views: Optional[List[torch.Tensor]] = None  # per-parameter views of ``flat``
        self.comp: Optional[torch.Tensor] = None  # persistent fp16/bf16 buffer
        self.direct = False  # one parameter, reduced in its own .grad
        self.remaining = len(params)  # gradients still to come before the bucket is sent
        self.sparse_dense: List[torch.Tensor] = []  # sparse grads sent densely this step
        self.dense_tmp: Dict[torch.Tensor, torch.Tensor] = {}  # sparse grads made dense
        self.skip: set = set()  # sparse grads sent on their own this step (not yet moved out)
        self.residuals: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # error feedback


def _hook(ref: Callable[[], Any], p: torch.Tensor) -> None:
    self = ref()
    if self is not None:
        self._grad_ready(p)


def _find_duplicates(lst: Sequence[Any]) -> set:
    seen = set()
    dups = set()
    for el in lst:
        if el in seen:
            dups.add(el)
        seen.add(el)
    return dups


def register_grad_hooks(owner: Any, params: List[torch.Tensor]) -> None:
    """Calls ``owner._grad_ready(p)`` once ``p``'s gradient has been accumulated (a backward
    pass), through a weak reference; the hooks go away with ``owner`` (Horovod's
    grad-accumulator hooks do as well)."""
    ref = weakref.ref(owner)
    handles = []
    for p in params:
        if hasattr(p, "register_post_accumulate_grad_hook"):
            handles.append(p.register_post_accumulate_grad_hook(lambda t, r=ref: _hook(r, t)))
        else:  # torch < 2.1: Horovod's grad accumulator hook
            p_tmp = p.expand_as(p)
            grad_acc = p_tmp.grad_fn.next_functions[0][0]
            handles.append(grad_acc.register_hook(lambda *_, r=ref, t=p: _hook(r, t)))
            owner._grad_accs.append(grad_acc)
    weakref.finalize(owner, _remove_hooks, handles)


def init_hook_state(
    opt: Any,
    named_parameters: Optional[Iterable[Tuple[str, Any]]],
    compression: Any,
    backward_passes_per_step: int,
) -> List[Tuple[str, Any]]:
    """The state both of Horovod's torch optimizers keep for their gradient hooks (names,
    countdown of backward passes, handles, Horovod's flags); returns the checked
    ``named_parameters``."""
    named = checked_named_parameters(opt.param_groups, named_parameters)
    opt._compression = compression
    opt._parameter_names = {v: k for k, v in sorted(named, key=lambda t: t[0])}
    opt.backward_passes_per_step = backward_passes_per_step
    opt._allreduce_delay = {v: backward_passes_per_step for _, v in named}
    opt._handles = {}
    opt._grad_accs = []
    opt._requires_update = set()
    opt._synchronized = False
    opt._should_synchronize = True
    return named


def checked_named_parameters(
    param_groups: List[Dict[str, Any]], named_parameters: Optional[Iterable[Tuple[str, Any]]]
) -> List[Tuple[str, Any]]:
    """``named_parameters`` as a list, checked as Horovod does (tuples, unique names, every
    parameter of ``param_groups`` named); None names them ``allreduce.noname.<group>.<index>``."""
    if named_parameters is not None:
        named_parameters = list(named_parameters)
    else:
        named_parameters = [
            (f"allreduce.noname.{i}.{j}", v)
            for i, param_group in enumerate(param_groups)
            for j, v in enumerate(param_group["params"])
        ]
    # make sure that named_parameters are tuples
    if any(not isinstance(p, tuple) for p in named_parameters):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually "
            "produced by model.named_parameters()."
        )

    dups = _find_duplicates([k for k, _ in named_parameters])
    if len(dups) > 0:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            f"{', '.join(dups)}"
        )

    all_param_ids = {id(v) for param_group in param_groups for v in param_group["params"]}
    named_param_ids = {id(v) for k, v in named_parameters}
    unnamed_param_ids = all_param_ids - named_param_ids
    if len(unnamed_param_ids):
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named. Python object ids: {', '.join(str(i) for i in unnamed_param_ids)}"
        )

    return named_parameters


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
        init_hook_state(self, named_parameters, compression, backward_passes_per_step)
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

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
        self._groups = groups

        if op == Average:
            # Average = Sum, then the core divides the postscale factor by size().
            self._prescale = 1.0 / gradient_predivide_factor
            self._postscale = gradient_predivide_factor
        else:
            self._prescale = 1.0
            self._postscale = 1.0

        # Bucket machinery (only used when hooks are registered).
        self._buckets: List[_Bucket] = []
        self._p_bucket: Dict[torch.Tensor, _Bucket] = {}
        self._p_view: Dict[torch.Tensor, torch.Tensor] = {}
        self._sparse_params: set = set()  # known sparse (allgather path), outside buckets
        self._sparse_dims: Dict[torch.Tensor, int] = {}
        self._hook_params: List[torch.Tensor] = []  # hooked params, param_groups order
        self._observed: Optional[List[torch.Tensor]] = None  # ready order during step 1
        self._layout_final = False
        self._hooks_registered = False
        # In an elastic job an algorithm's step counts must be rank 0's on every rank (a worker
        # that joins starts from 0): agreed at the first gradient hook, then after each reset.
        self._agree_steps = config.elastic()
        self._bucket_cap = _alg_common.bucket_bytes()
        # Steps whose update ran bucket by bucket, and the update calls they made (tests).
        self._bucketwise_steps = self._bucketwise_updates = 0
        self._cast_dtype = _CAST_COMPRESSORS.get(compression, False)

        if self.process_set.included() and (size() > 1 or config.elastic()):
            if algorithm is not None:
                from bagua_hvd.torch import algorithms as _alg

                self._algo_impl = _alg.implementation(algorithm, self, self._parameter_names)
            self._register_hooks()
            _LIVE.add(self)

    def _plan_again(self) -> None:
        """A new job was formed (an elastic reset): agree on the bucket layout (and an
        algorithm's step counts) again at the next step, as the workers that just joined do at
        their first; an algorithm drops what belonged to the old job (residuals, neighbours'
        replicas, its background averager)."""
        if self._hooks_registered:
            self._layout_final = False
            self._observed = []
            if self._algo_impl is not None:
                self._algo_impl.replan()
                self._agree_steps = True
                for b in self._buckets:
                    b.residuals = None

    def _agree_on_steps(self) -> None:
        """Every rank takes rank 0's step counts (the algorithm's distributed steps and, for
        QAdam, its optimizer's updates): the stages and rounds they select must match."""
        self._agree_steps = False
        impl = self._algo_impl
        if impl is None:
            return
        qadam = hasattr(self, "step_id")
        mine = [impl.step, self.step_id if qadam else 0]
        counts = torch.tensor(mine if self.process_set.rank() == 0 else [0, 0], dtype=torch.int64)
        counts = mpi_ops.allreduce(
            counts, name="DistributedOptimizer.steps", op=mpi_ops.Max, process_set=self.process_set
        ).tolist()
        impl.step = counts[0]
        if qadam:
            self.step_id = counts[1]

    # ---- Horovod's public surface --------------------------------------------------------------
    def load_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        self._reset_round()
        if self._observed is not None:
            self._observed = []
        super(self._hvd_cls, self).load_state_dict(*args, **kwargs)

    @staticmethod
    def find_duplicates(lst: Sequence[Any]) -> set:
        return _find_duplicates(lst)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Sets how many backward passes accumulate locally before gradients are reduced."""
        self.backward_passes_per_step = passes
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = self.backward_passes_per_step

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
        if self._hooks_registered:
            self._launch_missing()
            self._wait_and_finish()
            if not self._layout_final:
                self._finalize_layout()
        self._handles.clear()
        self._synchronized = True

    def _launch_missing(self) -> None:
        """Starts the reductions whose gradients did not all arrive through the hooks (unused
        parameters, fewer backward passes), with what ``p.grad`` holds."""
        handles = self._handles
        for b in self._buckets:
            entry = handles.get(b)
            if entry is None or entry[0] is None:
                self._launch(b, fill=True)
        for p in self._sparse_params:
            entry = handles.get(p)
            if entry is None or entry[0] is None:
                self._launch_sparse(p, fill=True)

    def _wait_and_finish(self, bucket_done: Optional[Callable[[_Bucket], None]] = None) -> None:
        """Waits for every reduction in launch order and writes its result to the gradients;
        ``bucket_done(b)`` after each bucket's."""
        for key, (handle, ctx) in self._handles.items():
            if isinstance(key, _Bucket):
                if type(handle) is Request:  # BAGUA's primitive (an algorithm's)
                    handle.wait()
                else:
                    mpi_ops.synchronize(handle)
                self._finish(key, ctx)
                if bucket_done is not None:
                    bucket_done(key)
            else:
                self._finish_sparse(key, handle())
        self._reset_round()

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
            elif self._bucketwise_update_applies(closure):
                self._synchronize_and_update_bucketwise()
                if self._algo_impl is not None:
                    self._algo_impl.after_step()
                return None
            self.synchronize()
        self._synchronized = False
        result = super(self._hvd_cls, self).step(closure)
        if self._algo_impl is not None:
            self._algo_impl.after_step()
        return result

    # ---- the update, bucket by bucket ------------------------------------------------------------
    def _bucketwise_update_applies(self, closure: Optional[Callable[[], Any]]) -> bool:
        """Whether step() may update each bucket's parameters as soon as that bucket's reduction
        completes, while later buckets are still on the wire: only where this gives the bits of
        one update after all of them (an optimizer whose update of a parameter depends on that
        parameter alone: the exact classes of _BUCKETWISE_OPTIMIZERS and those registered by
        register_partial_step), and where nothing can tell the difference (no closure, no step
        hooks, gradients averaged by this step itself, not between synchronize() and step(),
        the bucket layout final). A failed wait leaves the earlier buckets updated (an elastic
        job restores its last commit anyway)."""
        if closure is not None or not self._hooks_registered or not self._layout_final:
            return False
        if len(self._buckets) < 2 or not self.process_set.included():
            return False
        impl = self._algo_impl
        if impl is not None and not impl.communicates_gradients():
            return False
        base = self._hvd_cls.__mro__[1]
        if base not in _BUCKETWISE_OPTIMIZERS and base not in _PARTIAL_STEPS:
            return False
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks:
            return False
        if _global_step_hooks():
            return False
        return not any(g.get("differentiable") for g in self.param_groups)

    def _synchronize_and_update_bucketwise(self) -> None:
        """synchronize() and the wrapped optimizer's update, interleaved: after each bucket's
        wait, the update of its parameters (the wrapped class's step over them alone); then the
        update of every other parameter. The same waits, in the same order, as synchronize()."""
        self._launch_missing()
        base = self._hvd_cls.__mro__[1]
        groups = self.param_groups
        begin = _PARTIAL_STEPS.get(base)
        update = begin(self) if begin is not None else self._step_over(base)
        updated: set = set()
        ready: set = set()  # reduced, not yet updated
        ready_bytes = 0

        def update_only(ids: set) -> None:
            subset = []
            for g in groups:
                params = [p for p in g["params"] if id(p) in ids]
                if params:
                    subset.append(dict(g, params=params))
            if subset:
                update(subset)
                self._bucketwise_updates += 1
            updated.update(ids)

        def bucket_done(b: _Bucket) -> None:
            nonlocal ready_bytes
            # Its sparse gradients (sent on their own) are not final yet.
            for p in b.params:
                if p not in b.skip:
                    ready.add(id(p))
                    ready_bytes += p.numel() * p.element_size()
            if ready_bytes >= _BUCKETWISE_MIN_BYTES:
                update_only(ready)
                ready.clear()
                ready_bytes = 0

        with torch.autograd.profiler.record_function(f"Optimizer.step#{base.__name__}.step"):
            try:
                self._wait_and_finish(bucket_done)
            finally:
                self._handles.clear()
            update_only({id(p) for g in groups for p in g["params"]} - updated)
        self._bucketwise_steps += 1
        self._synchronized = False

    def _step_over(self, base: type) -> Callable[[List[Dict[str, Any]]], None]:
        """The update of a subset of param groups by ``base``'s own step (a torch optimizer):
        its step() over param_groups set to the subset."""
        step = base.step
        if getattr(step, "hooked", False):  # torch's hook wrapper: hooks run once (none here)
            step = getattr(step, "__wrapped__", step)

        def update(subset: List[Dict[str, Any]]) -> None:
            groups = self.param_groups
            self.param_groups = subset
            try:
                step(self)
            finally:
                self.param_groups = groups

        return update

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD_MESSAGE)
        return super(self._hvd_cls, self).zero_grad(*args, **kwargs)

    # ---- hooks -----------------------------------------------------------------------------------
    def _register_hooks(self) -> None:
        p_list = [
            p for param_group in self.param_groups for p in param_group["params"] if p.requires_grad
        ]
        self._hook_params = p_list
        if self._groups is not None:
            p_groups = self._form_groups(p_list)
        else:
            p_groups = self._form_buckets(list(reversed(p_list)), set())
        self._set_buckets(p_groups)
        self._flatten_all()

        self._requires_update.update(p_list)
        register_grad_hooks(self, p_list)
        self._observed = []
        self._hooks_registered = True

    def _form_groups(self, p_list: List[torch.Tensor]) -> List[List[torch.Tensor]]:
        # The same parameter order and groups on every rank: rank 0's order of names.
        names = [self._parameter_names.get(p) for p in p_list]
        root_names = _broadcast_names(names, self.process_set)
        p_list = sorted(p_list, key=lambda p: root_names.index(self._parameter_names.get(p)))
        if isinstance(self._groups, list):
            p_groups = []
            grouped_id = set()
            p_list_ids = {id(p) for p in p_list}
            for group in self._groups:
                p_groups.append([p for p in group if id(p) in p_list_ids])
                for p in p_groups[-1]:
                    grouped_id.add(id(p))
            for p in p_list:
                if id(p) not in grouped_id:
                    p_groups.append([p])
        else:
            p_groups = split_list(p_list, self._groups)
        return [list(g) for g in p_groups if len(g)]

    def _form_buckets(self, order: List[torch.Tensor], sparse: set) -> List[List[torch.Tensor]]:
        """Cuts ``order`` into buckets of at most the cap, one (dtype, device) per bucket."""
        params = [p for p in order if p not in sparse]
        infos = [(p.numel(), (p.dtype, p.device), p.element_size()) for p in params]
        layout = engine.bucket_layout(infos, self._bucket_cap, order=range(len(params)))
        return [[params[i] for i in b] for b in layout]

    def _set_buckets(self, p_groups: List[List[torch.Tensor]]) -> None:
        self._buckets = []
        self._p_bucket = {}
        op, pre, post = self.op, self._prescale, self._postscale
        for g in p_groups:
            b = _Bucket(g, engine.bucket_label(self._parameter_names.get(g[0]), len(g)))
            b.op, b.prescale, b.postscale = op, pre, post
            self._buckets.append(b)
            for p in g:
                self._p_bucket[p] = b

    def _grad_ready(self, p: torch.Tensor) -> None:
        """The gradient of ``p`` has been accumulated (one backward pass)."""
        if self._agree_steps:
            self._agree_on_steps()
        impl = self._algo_impl
        if impl is not None and not impl.communicates_gradients():
            impl.on_gradient(p)
            return
        delay = self._allreduce_delay
        d = delay[p]
        if d <= 0:
            raise AssertionError(_TOO_MANY_PASSES_MESSAGE)
        g = p.grad
        assert not g.requires_grad
        d -= 1
        delay[p] = d
        b = self._p_bucket.get(p)
        if d > 0:  # accumulate locally; the pending marker makes zero_grad() refuse
            self._handles.setdefault(p if b is None else b, (None, None))
            return
        if self._observed is not None:
            self._observed.append(p)
        if b is None:  # a known sparse gradient: allgather path
            self._launch_sparse(p)
            return
        if g.is_sparse:
            if not self.sparse_as_dense:
                self._new_sparse(p, b)
            elif b.views is not None:
                view = self._p_view[p]
                view.zero_()
                view.add_(g)
                b.sparse_dense.append(p)
            else:
                b.dense_tmp[p] = g.to_dense()
        elif b.views is not None:
            view = self._p_view[p]
            if g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
        b.remaining -= 1
        if b.remaining:
            self._handles.setdefault(b, (None, None))
        else:
            self._launch(b)

    def _new_sparse(self, p: torch.Tensor, b: _Bucket) -> None:
        """A sparse gradient of a parameter in a bucket: sent on its own (allgathers)."""
        self._sparse_params.add(p)
        b.skip.add(p)
        self._launch_sparse(p)

    # ---- communication ---------------------------------------------------------------------------
    def _launch(self, b: _Bucket, fill: bool = False) -> None:
        """Starts the bucket's allreduce: the bucket's kind decides what is sent, the algorithm
        (if any) which primitive sends it. ``fill``: called from synchronize(), so gradients
        that did not arrive through the hook (unused parameters, fewer backward passes) are
        taken from ``p.grad`` as they are, or zeros."""
        if b.flat is not None:
            tensors, ctx = self._flat_tensors(b, fill)
        elif b.direct:
            tensors, ctx = self._direct_tensors(b)
        else:
            tensors, ctx = self._list_tensors(b)
        if not tensors:  # only sparse gradients, sent on their own
            self._handles[b] = (_NO_HANDLE, None)
            return
        impl = self._algo_impl
        if impl is not None and (b.flat is not None or b.direct):
            request = impl.launch(
                b.params,
                tensors[0],
                _ops.op_name("allreduce", b.name),
                b,
                b.op,
                b.prescale,
                b.postscale,
            )
            if request is not None:
                self._handles[b] = (request, ctx)
                return
        if b.comp is not None:
            b.comp.copy_(tensors[0])
            tensors = [b.comp]
        handle = mpi_ops.bucket_allreduce_async(
            tensors,
            b.name,
            b.op,
            b.prescale,
            b.postscale,
            self.process_set,
            urgent=self._bucket_cap > 0 or self._groups is not None,
        )
        self._handles[b] = (handle, ctx)

    def _flat_tensors(self, b: _Bucket, fill: bool) -> Tuple[List[torch.Tensor], Any]:
        """A flat bucket: its buffer, whose views are the gradients."""
        if fill:
            views = b.views
            for i, p in enumerate(b.params):
                if p in b.skip:
                    continue
                g = p.grad
                view = views[i]
                if g is None:
                    # Not computed here, but other ranks may have computed it.
                    view.zero_()
                    p.grad = view
                elif g.is_sparse:
                    if not self.sparse_as_dense:
                        self._new_sparse(p, b)
                        continue
                    view.zero_()
                    view.add_(g)
                    if p not in b.sparse_dense:
                        b.sparse_dense.append(p)
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                    p.grad = view
        return [b.flat], None

    def _direct_tensors(self, b: _Bucket) -> Tuple[List[torch.Tensor], Any]:
        """A bucket of one parameter: its gradient, reduced where it is (no flat buffer)."""
        p = b.params[0]
        if p in b.skip:
            return [], None
        g = p.grad
        if g is None:
            # Not computed here, but other ranks may have computed it.
            g = p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        dense = b.dense_tmp.get(p)
        if dense is None and g.is_sparse:
            if not self.sparse_as_dense:
                self._new_sparse(p, b)
                return [], None
            dense = b.dense_tmp[p] = g.to_dense()
        t = g if dense is None else dense
        if not t.is_contiguous():  # e.g. channels_last: the core needs one dense block
            t = t.contiguous()
            if dense is None:
                p.grad = t
            else:
                b.dense_tmp[p] = t
        return [t], t

    def _list_tensors(self, b: _Bucket) -> Tuple[List[torch.Tensor], Any]:
        """Custom compressors, mixed groups: the (compressed) gradients, one grouped request."""
        tensors: List[torch.Tensor] = []
        ctxs: List[Tuple[torch.Tensor, Any, Optional[torch.Tensor]]] = []
        compression = self._compression
        for p in b.params:
            if p in b.skip:
                continue
            g = p.grad
            if g is None:
                # Not computed here, but other ranks may have computed it.
                g = p.grad = p.data.new(p.size()).zero_()
            dense = b.dense_tmp.get(p)
            if dense is None and g.is_sparse:
                if not self.sparse_as_dense:
                    self._new_sparse(p, b)
                    continue
                dense = b.dense_tmp[p] = g.to_dense()
            t = g if dense is None else dense
            if compression is NoneCompressor:
                tc, ctx = t, None
            else:
                tc, ctx = compression.compress(t)
            tensors.append(tc)
            ctxs.append((p, ctx, dense))
        return tensors, (tensors, ctxs)

    def _finish(self, b: _Bucket, ctx: Any) -> None:
        if b.direct:
            if ctx is not None:
                if b.comp is not None:
                    ctx.copy_(b.comp)
                if b.dense_tmp:
                    # sparse_as_dense: the gradient goes back to sparse before the update.
                    b.params[0].grad.zero_().add_(ctx.to_sparse())
                    b.dense_tmp.clear()
            return
        if b.flat is not None:
            if b.comp is not None:
                b.flat.copy_(b.comp)
            if b.sparse_dense:
                for p in b.sparse_dense:
                    aggregated = self._p_view[p].to_sparse()
                    p.grad.zero_().add_(aggregated)
                b.sparse_dense = []
            return
        if ctx is None:
            return
        tensors, ctxs = ctx
        compression = self._compression
        for out, (p, cctx, dense) in zip(tensors, ctxs):
            if compression is not NoneCompressor:
                out = compression.decompress(out, cctx)
            if dense is not None:
                # sparse_as_dense: the gradient goes back to sparse before the update.
                aggregated = out if out.is_sparse else out.to_sparse()
                p.grad.zero_().add_(aggregated)
            elif out is not p.grad:
                p.grad.set_(out)
        b.dense_tmp.clear()

    def _launch_sparse(self, p: torch.Tensor, fill: bool = False) -> None:
        g = p.grad
        if g is None:
            # No gradient on this rank: contribute an empty sparse tensor, so that the
            # allgathers still match the other ranks' (Horovod would send dense zeros here).
            sd = self._sparse_dims.get(p, 1)
            g = p.grad = torch.sparse_coo_tensor(
                torch.zeros((sd, 0), dtype=torch.int64, device=p.device),
                torch.zeros((0,) + tuple(p.shape[sd:]), dtype=p.dtype, device=p.device),
                p.shape,
            )
        elif not g.is_sparse:
            g = g.to_sparse(self._sparse_dims.get(p, 1))
        else:
            self._sparse_dims[p] = g.sparse_dim()
        name = self._parameter_names.get(p)
        handle = mpi_ops.sparse_allreduce_async(
            g, name=name, op=self.op, process_set=self.process_set
        )
        self._handles[p] = (handle, None)

    def _finish_sparse(self, p: torch.Tensor, aggregated: torch.Tensor) -> None:
        g = p.grad
        if g.is_sparse:
            # Sparse grads do not support set_, so this is the equivalent.
            g.zero_().add_(aggregated)
        else:
            p.grad = aggregated

    def _reset_round(self) -> None:
        bpps = self.backward_passes_per_step
        delay = self._allreduce_delay
        for p in delay:
            delay[p] = bpps
        for b in self._buckets:
            b.remaining = len(b.params)
            b.skip.clear()
            b.dense_tmp.clear()
            b.sparse_dense = []

    # ---- layout ------------------------------------------------------------------------------------
    def _finalize_layout(self) -> None:
        """After the first step: rebuild the buckets in the observed ready order (rank 0's) and
        move sparse gradients out of them, if that changes the first guess (the gradients are
        then copied into the new buffers)."""
        params = self._hook_params
        n = len(params)
        index = {p: i for i, p in enumerate(params)}
        observed = self._observed or []
        self._observed = None
        order_idx = [index[p] for p in observed if p in index]
        seen = set(order_idx)
        order_idx += [i for i in reversed(range(n)) if i not in seen]
        # One allreduce(Max) carries rank 0's order (others send zeros) and every rank's
        # sparse flags.
        info = torch.zeros(2 * n, dtype=torch.int64)
        if self.process_set.rank() == 0 and n:
            info[:n] = torch.tensor(_positions(order_idx, n), dtype=torch.int64)
        for p in self._sparse_params:
            info[n + index[p]] = 1
        info = mpi_ops.allreduce(
            info,
            name="DistributedOptimizer.layout",
            op=mpi_ops.Max,
            process_set=self.process_set,
        )
        pos = info[:n].tolist()
        sparse_flags = info[n:].tolist()
        sparse = {params[i] for i in range(n) if sparse_flags[i]}
        if not self.sparse_as_dense:
            self._sparse_params = sparse
        if self._groups is None:
            order = [params[i] for i in sorted(range(n), key=lambda i: pos[i])]
            groups = self._form_buckets(order, self._sparse_params)
        else:
            groups = [[p for p in b.params if p not in self._sparse_params] for b in self._buckets]
            groups = [g for g in groups if g]
        self._layout_final = True
        if [[id(p) for p in g] for g in groups] == [
            [id(p) for p in b.params] for b in self._buckets
        ]:
            return  # the first guess was right
        # New buckets: new flat buffers (the gradients are copied over, the old buffers freed).
        self._set_buckets(groups)
        self._flatten_all()

    def _flatten_all(self) -> None:
        self._p_view = {}
        if self._cast_dtype is not False:  # element-wise compression (or none)
            for b in self._buckets:
                self._flatten(b)

    def _flatten(self, b: _Bucket) -> None:
        p0 = b.params[0]
        dtype, device = p0.dtype, p0.device
        cast = self._cast_dtype
        if len(b.params) == 1:
            # Nothing to fuse: reduce the gradient itself, in place, without a copy into a
            # buffer (no copy, and no second gradient-sized buffer).
            b.direct = True
            if cast is not None and dtype.is_floating_point and dtype != cast:
                b.comp = torch.empty(p0.shape, dtype=cast, device=device)
            return
        if any(p.dtype != dtype or p.device != device for p in b.params):
            return  # mixed bucket (user groups): stays a grouped allreduce
        total = sum(p.numel() for p in b.params)
        flat = torch.zeros(total, dtype=dtype, device=device)
        views = []
        off = 0
        with torch.no_grad():
            for p in b.params:
                k = p.numel()
                view = flat[off : off + k].view(p.shape)
                off += k
                g = p.grad
                if g is not None:
                    if g.is_sparse:
                        view.add_(g)
                    else:
                        view.copy_(g)
                        p.grad = view
                views.append(view)
                self._p_view[p] = view
        b.flat = flat
        b.views = views
        if cast is not None and dtype.is_floating_point and dtype != cast:
            b.comp = torch.empty(total, dtype=cast, device=device)


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


def _positions(order_idx: List[int], n: int) -> List[int]:
    pos = [0] * n
    for k, i in enumerate(order_idx):
        pos[i] = k
    return pos


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _remove_hooks(handles: List[Any]) -> None:
    for h in handles:
        try:
            h.remove()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _broadcast_names(names: List[Optional[str]], process_set: ProcessSet) -> List[Optional[str]]:
    """Rank 0's list of names (process-set rank 0), on every rank of the set."""
    import json

    root = process_set.ranks[0] if process_set.ranks else 0
    data = torch.tensor(list(json.dumps(names).encode("utf-8")), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    length = mpi_ops.broadcast(
        length, root, name="DistributedOptimizer.groups.size", process_set=process_set
    )
    buf = torch.zeros(int(length[0]), dtype=torch.uint8)
    if process_set.rank() == 0:
        buf = data
    buf = mpi_ops.broadcast(
        buf, root, name="DistributedOptimizer.groups.names", process_set=process_set
    )
    return json.loads(bytes(buf.tolist()).decode("utf-8"))


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
            ``QAdamAlgorithm``, ``AsyncModelAverage``; docs/algorithms.md). Default: None, which
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

    from bagua_hvd.torch import algorithms as _alg

    if algorithm is None:
        algorithm = _alg.from_environment()
    if op == Adasum and size() > 1:
        if algorithm is not None:
            raise ValueError(
                "op=hvd.Adasum is Horovod's reduction of the updates; it does not combine with "
                f"BAGUA's algorithm {type(algorithm).__name__} (BAGUA_HVD_ALGORITHM or "
                "algorithm=)"
            )
        if _ops.process_set_id(process_set) != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        from bagua_hvd.torch.adasum import _DistributedAdasumOptimizer

        cls = type(
            optimizer.__class__.__name__,
            (optimizer.__class__,),
            dict(_DistributedAdasumOptimizer.__dict__),
        )
        cls._hvd_cls = cls
        return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step)
    if algorithm is not None:
        _alg_common.check_algorithm(algorithm, "torch")
        op = algorithm.reduce_op(op)
        algorithm.check(optimizer, _alg.QAdamOptimizer, compression is not Compression.none, groups)

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
