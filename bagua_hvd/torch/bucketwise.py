"""``DistributedOptimizer.step()``'s update, bucket by bucket: after each bucket's wait, the
wrapped optimizer's update of that bucket's parameters, while later buckets are still on the
wire; only where this gives the bits of one update of all (docs/algorithms.md)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from bagua_hvd.torch.buckets import Bucket

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


def applies(opt: Any, closure: Optional[Callable[[], Any]]) -> bool:
    """Whether ``opt.step()`` may update each bucket's parameters as soon as that bucket's
    reduction completes: only where this gives the bits of one update after all of them (an
    optimizer whose update of a parameter depends on that parameter alone: the exact classes of
    _BUCKETWISE_OPTIMIZERS and those registered by register_partial_step), and where nothing can
    tell the difference (no closure, no step hooks, gradients averaged by this step itself, not
    between synchronize() and step(), the bucket layout final). A failed wait leaves the
    earlier buckets updated (an elastic job restores its last commit anyway)."""
    buckets = opt._bucketing
    if closure is not None or buckets is None or not buckets.layout_final:
        return False
    if len(buckets.buckets) < 2 or not opt.process_set.included():
        return False
    impl = opt._algo_impl
    if impl is not None and not impl.communicates_gradients():
        return False
    base = opt._hvd_cls.__mro__[1]
    if base not in _BUCKETWISE_OPTIMIZERS and base not in _PARTIAL_STEPS:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if _global_step_hooks():
        return False
    return not any(g.get("differentiable") for g in opt.param_groups)


class Update:
    """One step's update by parts: :meth:`bucket_done` after each bucket's wait (its
    parameters, merged with the next buckets' below _BUCKETWISE_MIN_BYTES), then :meth:`rest`
    (every parameter not updated yet). Each part is the wrapped class's step over those
    parameters alone; ``opt._bucketwise_updates`` counts the calls."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.base: type = opt._hvd_cls.__mro__[1]
        begin = _PARTIAL_STEPS.get(self.base)
        self._update = begin(opt) if begin is not None else _step_over(opt, self.base)
        self._updated: set = set()
        self._ready: set = set()  # reduced, not yet updated
        self._ready_bytes = 0

    def bucket_done(self, b: Bucket) -> None:
        # Its sparse gradients (sent on their own) are not final yet.
        for p in b.params:
            if p not in b.skip:
                self._ready.add(id(p))
                self._ready_bytes += p.numel() * p.element_size()
        if self._ready_bytes >= _BUCKETWISE_MIN_BYTES:
            self._update_only(self._ready)
            self._ready = set()
            self._ready_bytes = 0

    def rest(self) -> None:
        groups = self.opt.param_groups
        self._update_only({id(p) for g in groups for p in g["params"]} - self._updated)

    def _update_only(self, ids: set) -> None:
        subset = []
        for g in self.opt.param_groups:
            params = [p for p in g["params"] if id(p) in ids]
            if params:
                subset.append(dict(g, params=params))
        if subset:
            self._update(subset)
            self.opt._bucketwise_updates += 1
        self._updated.update(ids)


def _step_over(opt: Any, base: type) -> Callable[[List[Dict[str, Any]]], None]:
    """The update of a subset of param groups by ``base``'s own step (a torch optimizer):
    its step() over param_groups set to the subset."""
    step = base.step
    if getattr(step, "hooked", False):  # torch's hook wrapper: hooks run once (none here)
        step = getattr(step, "__wrapped__", step)

    def update(subset: List[Dict[str, Any]]) -> None:
        groups = opt.param_groups
        opt.param_groups = subset
        try:
            step(opt)
        finally:
            opt.param_groups = groups

    return update
