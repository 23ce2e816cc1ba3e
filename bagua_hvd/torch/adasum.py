"""``hvd.DistributedOptimizer(..., op=hvd.Adasum)`` with more than one rank: Horovod's delta
optimizer (``horovod.torch.optimizer._DistributedAdasumOptimizer``).

Each rank applies the wrapped optimizer to a parameter as soon as its gradient is ready (in the
backward hook, the optimizer stepping that parameter alone), takes the change of the parameter
(delta = new - start) and reduces the deltas with Adasum; ``step()`` then sets every parameter
to start + Adasum(deltas). So the optimizer's own update (momentum, Adam's moments, ...) runs
on the local gradient, and Adasum combines the updates (docs/adasum.md).

As Horovod: no averaging of gradients, ``synchronize()`` does nothing and ``skip_synchronize()``
raises; the wrapped optimizer starts with fresh state; global process set only; a power-of-2
number of ranks; float16/32/64 parameters on the CPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional, Tuple

import torch

import bagua_hvd.torch.hooks as _hooks
from bagua_hvd.torch.hooks import NOT_STARTED, TOO_MANY_PASSES_MESSAGE, Pending
from bagua_hvd.torch.mpi_ops import Adasum, allreduce_async_


def _decompressed(arg: Tuple[Any, Any], out: torch.Tensor) -> torch.Tensor:
    compression, ctx = arg
    return compression.decompress(out, ctx)


class _DistributedAdasumOptimizer(torch.optim.Optimizer):
    # As _DistributedOptimizer: the methods are copied into a class derived from the wrapped
    # optimizer's class, which is ``_hvd_cls``.
    _hvd_cls: type

    def __init__(
        self,
        params: Any,
        named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int = 1,
    ) -> None:
        super(self._hvd_cls, self).__init__(params)
        named = _hooks.init_hook_state(
            self, named_parameters, compression, backward_passes_per_step
        )
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        p_list = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        for p in p_list:
            p.grad = p.data.new(p.size()).zero_()
        self._requires_update.update(p_list)
        _hooks.register_grad_hooks(self, p_list)

    set_backward_passes_per_step = _hooks.set_backward_passes_per_step
    zero_grad = _hooks.zero_grad

    def _allreduce_grad_async(self, p: torch.Tensor) -> Pending:
        """Starts the reduction of ``p``'s delta; its wait() returns the combined delta."""
        # delta = (start - lr * f(g)) - start: the wrapped optimizer steps p alone from start.
        start = self._starting_models[p]
        stashed = []
        for group in self.param_groups:
            stashed.append(group["params"])
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.data.copy_(p)
            super(self._hvd_cls, self).step()
            p.data.sub_(start)
            compressed, ctx = self._compression.compress(p)
            handle = allreduce_async_(compressed.data, name=self._parameter_names.get(p), op=Adasum)
        finally:
            for params, group in zip(stashed, self.param_groups):
                group["params"] = params
        return Pending(handle, _decompressed, (self._compression, ctx))

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p in self._handles and self._handles[p].started:
            if self._allreduce_delay[p] <= 0:
                raise AssertionError(TOO_MANY_PASSES_MESSAGE)
        assert not p.grad.requires_grad
        assert self._allreduce_delay[p] > 0
        self._allreduce_delay[p] -= 1
        if self._allreduce_delay[p] == 0:
            self._handles[p] = self._allreduce_grad_async(p)
        else:
            self._handles[p] = NOT_STARTED

    def synchronize(self) -> None:
        pass

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover - a generator for contextmanager

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            loss = closure()
        for p in self._requires_update - set(self._handles):
            self._handles[p] = self._allreduce_grad_async(p)
        for p, pending in self._handles.items():
            if not pending.started:  # step() before backward_passes_per_step passes: reduce now
                pending = self._handles[p] = self._allreduce_grad_async(p)
            delta = pending.wait()
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss
