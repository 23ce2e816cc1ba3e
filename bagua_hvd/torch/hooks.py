"""What both of Horovod's torch optimizers (``DistributedOptimizer``'s allreduce and Adasum) keep
for their gradient hooks: the parameter names, the countdown of backward passes, Horovod's flags
and messages, and the pending reductions (:class:`Pending`, the one type of ``_handles``'
values)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

import bagua_hvd.torch.mpi_ops as mpi_ops
from bagua_hvd.common.primitives import Request

ZERO_GRAD_MESSAGE = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
TOO_MANY_PASSES_MESSAGE = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


class Pending:
    """One reduction of an optimizer's, whichever call started it: ``handle`` is a handle of
    ``mpi_ops`` (an int), BAGUA's ``Request``, or a callable that waits (the sparse
    allgathers); None: not started yet (:data:`NOT_STARTED`: gradients still accumulate
    locally; zero_grad() refuses). ``wait()`` blocks until it completes and returns its result,
    or ``finish(arg, result)``, which writes it where it belongs. (Allocates one object: a
    step holds one per bucket, and more would set off the garbage collector every step.)"""

    __slots__ = ("handle", "finish", "arg", "started")

    def __init__(
        self,
        handle: Any,
        finish: Optional[Callable[[Any, Any], Any]] = None,
        arg: Any = None,
    ) -> None:
        self.handle = handle
        self.finish = finish
        self.arg = arg
        self.started = handle is not None

    def wait(self) -> Any:
        h = self.handle
        if type(h) is int:
            out = mpi_ops.synchronize(h)
        elif type(h) is Request:
            h.wait()  # in place: the result is where the request was given it
            out = None
        elif h is None:
            raise AssertionError("a reduction that was not started cannot be waited for")
        else:
            out = h()
        return out if self.finish is None else self.finish(self.arg, out)


NOT_STARTED = Pending(None)


def _hook(ref: Callable[[], Any], p: torch.Tensor) -> None:
    self = ref()
    if self is not None:
        self._grad_ready(p)


def find_duplicates(lst: Sequence[Any]) -> set:
    seen = set()
    dups = set()
    for el in lst:
        if el in seen:
            dups.add(el)
        seen.add(el)
    return dups


def register_grad_hooks(
    owner: Any, params: List[torch.Tensor], ready: Optional[Callable[[torch.Tensor], None]] = None
) -> None:
    """Calls ``ready(p)`` once ``p``'s gradient has been accumulated (a backward pass), or
    without ``ready``, ``owner._grad_ready(p)`` through a weak reference. The hooks go away with
    ``owner`` (Horovod's grad-accumulator hooks do as well), so ``ready`` must not refer to
    ``owner``: the parameters hold their hooks. ``ready`` is registered as it is, so that a
    gradient reaches the core in as few calls as Horovod's (docs/design-core.md)."""
    ref = weakref.ref(owner)
    handles = []
    for p in params:
        if hasattr(p, "register_post_accumulate_grad_hook"):
            hook = ready if ready is not None else (lambda t, r=ref: _hook(r, t))
            handles.append(p.register_post_accumulate_grad_hook(hook))
        else:  # torch < 2.1: Horovod's grad accumulator hook
            p_tmp = p.expand_as(p)
            grad_acc = p_tmp.grad_fn.next_functions[0][0]
            if ready is not None:
                handles.append(grad_acc.register_hook(lambda *_, f=ready, t=p: f(t)))
            else:
                handles.append(grad_acc.register_hook(lambda *_, r=ref, t=p: _hook(r, t)))
            owner._grad_accs.append(grad_acc)
    weakref.finalize(owner, _remove_hooks, handles)


def _remove_hooks(handles: List[Any]) -> None:
    for h in handles:
        try:
            h.remove()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


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
    opt._handles = {}  # key (bucket or parameter) -> Pending; cleared, never rebound
    opt._grad_accs = []
    opt._requires_update = set()
    opt._synchronized = False
    opt._should_synchronize = True
    return named


# The methods both optimizers share (copied into their classes; Horovod's code has them twice).
def set_backward_passes_per_step(self: Any, passes: int) -> None:
    """Sets how many backward passes accumulate locally before gradients are reduced."""
    self.backward_passes_per_step = passes
    for p in self._allreduce_delay:
        self._allreduce_delay[p] = self.backward_passes_per_step


def zero_grad(self: Any, *args: Any, **kwargs: Any) -> None:
    if self._handles:
        raise AssertionError(ZERO_GRAD_MESSAGE)
    return super(self._hvd_cls, self).zero_grad(*args, **kwargs)


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

    dups = find_duplicates([k for k, _ in named_parameters])
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
