"""What bagua_hvd's Lightning strategy does, whichever Lightning package it plugs into.

``lightning.pytorch`` and the standalone ``pytorch_lightning`` each have their own
``ParallelStrategy`` and ``ClusterEnvironment`` classes, and a Trainer accepts only its own
package's. The behaviour lives here, in two mixins that import no Lightning package at module
level; ``bagua_hvd/lightning/strategy.py`` and ``bagua_hvd/lightning/pytorch_lightning.py``
combine them with each package's base classes (the mixin first, so that its methods win and its
``super()`` calls reach Lightning's).
"""

from __future__ import annotations

import functools
import inspect
import os
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

import bagua_hvd.torch as hvd
from bagua_hvd.common import algorithms as _algorithms
from bagua_hvd.torch.functions import _is_distributed_optimizer

#: What ``algorithm=`` takes: None (``bagua-run --algorithm``, else Horovod's allreduce), ``"auto"``,
#: an object of ``bagua_hvd.torch.algorithms``, or a callable that builds one per optimizer.
AlgorithmArg = Union[None, str, _algorithms.Algorithm, Callable[[torch.optim.Optimizer], Any]]

# The strategy passes these to DistributedOptimizer itself.
_SET_BY_STRATEGY = ("optimizer", "named_parameters", "backward_passes_per_step", "algorithm")

# Lightning's reduce ops (strings, or torch.distributed.ReduceOp members, whose name is used)
# and Horovod's.
_REDUCE_OPS = {
    "mean": hvd.Average,
    "avg": hvd.Average,
    "sum": hvd.Sum,
    "max": hvd.Max,
    "min": hvd.Min,
    "product": hvd.Product,
}

_NO_SYNC_BATCHNORM = (
    "Trainer(sync_batchnorm=True) converts the model's BatchNorm layers to "
    "torch.nn.SyncBatchNorm, which needs torch.distributed; HorovodStrategy does not start it. "
    "Build the model with bagua_hvd.torch.SyncBatchNorm instead and leave sync_batchnorm unset."
)


def _check_algorithm(algorithm: Any) -> None:
    if isinstance(algorithm, type):
        raise ValueError(
            f"HorovodStrategy(algorithm={algorithm.__name__}): pass an object, "
            f"{algorithm.__name__}(...), not the class"
        )
    if algorithm is None or isinstance(algorithm, _algorithms.Algorithm) or callable(algorithm):
        return
    if isinstance(algorithm, str) and algorithm.strip().lower() == _algorithms.AUTO_NAME:
        return
    raise ValueError(
        'HorovodStrategy(algorithm=...) takes an object of bagua_hvd.torch.algorithms, "auto", '
        "a callable optimizer -> algorithm (one per optimizer, e.g. "
        f"lambda opt: QAdamAlgorithm(opt)) or None; got {algorithm!r}"
    )


def _checked_optimizer_kwargs(kwargs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``optimizer_kwargs``, refused (ValueError) when DistributedOptimizer has no such argument
    or the strategy sets it."""
    kwargs = dict(kwargs or {})
    accepted = set(inspect.signature(hvd.DistributedOptimizer).parameters) - set(_SET_BY_STRATEGY)
    set_here = sorted(k for k in kwargs if k in _SET_BY_STRATEGY)
    if set_here:
        raise ValueError(
            f"HorovodStrategy sets {', '.join(set_here)} of DistributedOptimizer itself "
            "(algorithm= is the strategy's own argument; backward_passes_per_step follows "
            "Trainer(accumulate_grad_batches=...)): remove it from optimizer_kwargs"
        )
    unknown = sorted(k for k in kwargs if k not in accepted)
    if unknown:
        raise ValueError(
            f"DistributedOptimizer has no argument {', '.join(unknown)}; optimizer_kwargs takes "
            f"{', '.join(sorted(accepted))}"
        )
    return kwargs


def _reduce_op(reduce_op: Any) -> int:
    """Horovod's op for Lightning's ``reduce_op`` (None is the mean)."""
    if reduce_op is None:
        key = "mean"
    elif isinstance(reduce_op, str):
        key = reduce_op.lower()
    else:  # torch.distributed.ReduceOp.SUM and friends
        key = str(getattr(reduce_op, "name", reduce_op)).lower()
    if key not in _REDUCE_OPS:
        raise ValueError(
            f"HorovodStrategy.reduce: unsupported reduce_op {reduce_op!r}; use one of "
            f"{', '.join(repr(k) for k in _REDUCE_OPS)} or the torch.distributed.ReduceOp of one"
        )
    return _REDUCE_OPS[key]


def _check_group(group: Any, what: str) -> None:
    """Collectives run over every rank: ``group`` may only name the world (LightningModule's
    ``all_gather`` passes ``torch.distributed.group.WORLD``, which is None while
    torch.distributed is not initialized)."""
    if group is None:
        return
    world = getattr(getattr(torch.distributed, "group", None), "WORLD", None)
    if group is not world:
        raise ValueError(
            f"HorovodStrategy.{what} runs over every rank of the job: process groups are not "
            "supported, leave group unset"
        )


class _AllGather(torch.autograd.Function):
    """Every rank's tensor stacked on a new dim 0; the gradient of a rank's input is the sum
    over ranks of the gradients of its row (as torch.distributed.nn's all_gather: the gradient of
    the ranks' summed loss)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return hvd.allgather(tensor.unsqueeze(0).contiguous(), name="lightning.all_gather")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        summed = hvd.allreduce(grad.contiguous(), op=hvd.Sum, name="lightning.all_gather.grad")
        return summed[hvd.rank()]


def _track_steps_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """torch's LRScheduler wraps its optimizer's ``step`` when built, and warns at its first step
    if that wrapper is gone or did not run. The scheduler now holds the DistributedOptimizer
    instead: it gets the same wrapper (an instance attribute, as torch does)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)  # the optimizer holds this function: no cycle through it
    func = type(optimizer).step

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step  # type: ignore[method-assign]


class EnvironmentMixin:
    """A Lightning ``ClusterEnvironment`` whose ranks are bagua_hvd's (``hvd.init()`` first): the
    launcher (bagua-run, mpirun, srun, Ray, ...) started the processes and set their ranks;
    Lightning starts none and sets none."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        # torch.distributed's rendezvous address, which bagua_hvd does not use.
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        return int(os.environ.get("MASTER_PORT", "0"))

    @staticmethod
    def detect() -> bool:
        """Whether this process was started by bagua-run (or another launcher setting
        Horovod's rank variables)."""
        return "HOROVOD_RANK" in os.environ

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher decides the job's size."""

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher decides the ranks."""

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


class StrategyMixin:
    """The behaviour of ``HorovodStrategy`` (its docstring is the concrete classes')."""

    #: the ClusterEnvironment class of the same Lightning package (set by the concrete class)
    environment_class: type
    strategy_name = "horovod"

    def __init__(
        self,
        algorithm: AlgorithmArg = None,
        *,
        scale_lr: bool = True,
        optimizer_kwargs: Optional[Dict[str, Any]] = None,
        accelerator: Any = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        _check_algorithm(algorithm)
        kwargs = _checked_optimizer_kwargs(optimizer_kwargs)
        # The ranks exist from here on: rank_zero_only (Lightning's logging, progress bar,
        # loggers) needs them before the Trainer prints anything.
        hvd.init()
        super().__init__(  # type: ignore[call-arg]
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment or self.environment_class(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.algorithm = algorithm
        self.scale_lr = scale_lr
        self.optimizer_kwargs = kwargs
        self._algorithms: List[Any] = []  # those given to this fit's DistributedOptimizers
        self.set_world_ranks()

    # ---- ranks and devices -----------------------------------------------------------------
    def set_world_ranks(self) -> None:
        """Tells Lightning's rank-zero-only helpers this process's rank."""
        # Both Lightning packages use lightning_utilities' (imported here: this module imports
        # no Lightning package, so that a missing one is reported by _package.require).
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @property
    def is_distributed(self) -> bool:
        """More than one rank: Lightning then gives each rank its part of the data."""
        return self.world_size > 1  # type: ignore[attr-defined]

    @property
    def root_device(self) -> torch.device:
        """This rank's device: the CPU, or with a GPU accelerator the local rank's GPU (the
        ``local_rank``-th of ``Trainer(devices=...)`` where that names several, else
        ``cuda:local_rank`` where this process sees several GPUs, else the one it sees)."""
        devices = self.parallel_devices or [torch.device("cpu")]  # type: ignore[attr-defined]
        if devices[0].type != "cuda":
            return devices[0]
        local = self.local_rank  # type: ignore[attr-defined]
        if len(devices) > 1:
            if local >= len(devices):
                raise RuntimeError(
                    f"local rank {local} has no GPU among Trainer(devices=...)'s {len(devices)}: "
                    "start at most that many ranks per host"
                )
            return devices[local]
        count = torch.cuda.device_count()
        if count <= 1:
            return devices[0]
        if local >= count:
            raise RuntimeError(
                f"local rank {local} has no GPU: this host shows {count}; start at most that "
                "many ranks per host"
            )
        return torch.device("cuda", local)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        devices = self.parallel_devices  # type: ignore[attr-defined]
        if devices and len(devices) > 1 and devices[0].type != "cuda":
            raise ValueError(
                f"Trainer(devices={len(devices)}) asks Lightning to start {len(devices)} "
                "processes; with HorovodStrategy the launcher starts them "
                "(bagua-run -np N): use Trainer(devices=1)"
            )
        if self._layer_sync is not None:  # type: ignore[attr-defined]
            raise ValueError(_NO_SYNC_BATCHNORM)
        if self.root_device.type == "cuda":
            torch.cuda.set_device(self.root_device)
        super().setup_environment()  # type: ignore[misc]

    def model_to_device(self) -> None:
        self.model.to(self.root_device)  # type: ignore[attr-defined]

    # ---- setup: broadcast from rank 0, then DistributedOptimizer -----------------------------
    def setup(self, trainer: Any) -> None:
        """Lightning's setup (model on the device, optimizers built); when fitting, then: the
        learning rates scaled by the number of ranks (``scale_lr``), rank 0's parameters,
        buffers and optimizer state broadcast, and each optimizer wrapped in a
        DistributedOptimizer (``backward_passes_per_step`` =
        ``Trainer(accumulate_grad_batches=...)``)."""
        super().setup(trainer)  # type: ignore[misc]
        self._algorithms = []
        if trainer.state.fn != "fit":
            return
        optimizers = list(self.optimizers)  # type: ignore[attr-defined]
        if self.scale_lr:
            self._scale_learning_rates(optimizers)
        module = self.lightning_module  # type: ignore[attr-defined]
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
        for opt in optimizers:
            # LBFGS's state is not per parameter (Horovod cannot broadcast it); it is empty on
            # every rank here (a resumed fit restores it later, on every rank).
            if not isinstance(opt, torch.optim.LBFGS):
                hvd.broadcast_optimizer_state(opt, root_rank=0)
        wrapped = [self._distributed(opt, len(optimizers), trainer) for opt in optimizers]
        for old, new in zip(optimizers, wrapped):
            self._rebind_schedulers(old, new)
        self.optimizers = wrapped  # type: ignore[attr-defined]

    def _scale_learning_rates(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Horovod's recipe (and Lightning 1.x's HorovodStrategy): the global batch grows with
        the ranks, so does the learning rate; the schedulers' base rates with it."""
        n = self.world_size  # type: ignore[attr-defined]
        if n == 1:
            return
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] *= n
                if "initial_lr" in group:  # a scheduler's starting point
                    group["initial_lr"] *= n
        for config in self.lr_scheduler_configs:  # type: ignore[attr-defined]
            scheduler = config.scheduler
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr * n for lr in scheduler.base_lrs]

    def _distributed(
        self, opt: torch.optim.Optimizer, n_optimizers: int, trainer: Any
    ) -> torch.optim.Optimizer:
        """``opt`` wrapped in a DistributedOptimizer, or as it is when it is one already."""
        if _is_distributed_optimizer(opt):
            return opt
        algorithm = self.algorithm
        if callable(algorithm) and not isinstance(algorithm, _algorithms.Algorithm):
            algorithm = algorithm(opt)
        elif isinstance(algorithm, _algorithms.Algorithm) and n_optimizers > 1:
            raise ValueError(
                f"HorovodStrategy(algorithm={type(algorithm).__name__}(...)) with "
                f"{n_optimizers} optimizers: an algorithm object serves one optimizer; pass a "
                "callable that builds one per optimizer, e.g. algorithm=lambda opt: ByteGrad()"
            )
        self._algorithms.append(algorithm)
        mine = {id(p) for group in opt.param_groups for p in group["params"]}
        named = [
            (name, p)
            for name, p in self.lightning_module.named_parameters()  # type: ignore[attr-defined]
            if id(p) in mine
        ]
        return hvd.DistributedOptimizer(
            opt,
            named_parameters=named,
            backward_passes_per_step=trainer.accumulate_grad_batches,
            algorithm=algorithm,
            **self.optimizer_kwargs,
        )

    def _rebind_schedulers(self, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
        """Schedulers built on ``old`` drive ``new``: they share the param groups now, but a
        checkpoint's optimizer state replaces ``new``'s groups when a fit resumes."""
        if old is new:
            return
        for config in self.lr_scheduler_configs:  # type: ignore[attr-defined]
            scheduler = config.scheduler
            if getattr(scheduler, "optimizer", None) is old:
                scheduler.optimizer = new
                if hasattr(old.step, "_wrapped_by_lr_sched"):
                    _track_steps_for_schedulers(new)

    # ---- the step -----------------------------------------------------------------------------
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning runs the forward and backward pass inside ``optimizer.step(closure)``: the
        DistributedOptimizer must not wait for gradients before it. The gradients are
        synchronized at the end of the closure instead, so that what Lightning does after it
        (gradient clipping, ``on_before_optimizer_step``) sees the averaged gradients."""
        if not _is_distributed_optimizer(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

        def closure_then_synchronize() -> Any:
            result = closure()
            optimizer.synchronize()  # type: ignore[attr-defined]
            return result

        with optimizer.skip_synchronize():  # type: ignore[attr-defined]
            return super().optimizer_step(  # type: ignore[misc]
                optimizer, closure_then_synchronize, model, **kwargs
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follows a change of ``accumulate_grad_batches`` (GradientAccumulationScheduler
        changes it at an epoch's start, between two steps)."""
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        passes = self.lightning_module.trainer.accumulate_grad_batches  # type: ignore[attr-defined]
        for opt in self.optimizers:  # type: ignore[attr-defined]
            if _is_distributed_optimizer(opt) and opt.backward_passes_per_step != passes:
                opt.set_backward_passes_per_step(passes)

    def on_train_end(self) -> None:
        """Asynchronous model averaging stops with the training: the weights are final."""
        for algorithm in self._algorithms:
            if isinstance(algorithm, _algorithms.AsyncModelAverage):
                algorithm.abort()
        super().on_train_end()  # type: ignore[misc]

    # ---- collectives ---------------------------------------------------------------------------
    def reduce(
        self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Any:
        """Every rank's ``tensor`` reduced (``"mean"`` by default, ``"sum"``, ``"max"``,
        ``"min"``, ``"product"`` or the torch.distributed.ReduceOp of one), as a new tensor;
        a value that is not a tensor is returned as it is. The mean of an integer tensor is
        truncated toward zero, as Lightning's DDP strategy does."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        _check_group(group, "reduce")
        op = _reduce_op(reduce_op)
        if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            total = hvd.allreduce(tensor, op=hvd.Sum, name="lightning.reduce")
            return torch.div(total, hvd.size(), rounding_mode="trunc").to(tensor.dtype)
        return hvd.allreduce(tensor, op=op, name="lightning.reduce")

    def all_gather(
        self, tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False
    ) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape everywhere) stacked: shape
        ``(world_size, *tensor.shape)``; at one rank ``tensor`` itself (Lightning's contract).
        With ``sync_grads`` the result is differentiable: a rank's input receives the sum of the
        gradients of its row over all ranks."""
        _check_group(group, "all_gather")
        if self.world_size == 1:  # type: ignore[attr-defined]
            return tensor
        if sync_grads and torch.is_grad_enabled() and tensor.requires_grad:
            return _AllGather.apply(tensor)
        return hvd.allgather(tensor.detach().unsqueeze(0).contiguous(), name="lightning.all_gather")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable value) on every rank."""
        if not 0 <= src < self.world_size:  # type: ignore[attr-defined]
            raise ValueError(f"broadcast: src {src} is not a rank of {self.world_size}")  # type: ignore[attr-defined]
        # One name for every call: the default (the object's type) differs between ranks where
        # only src has a value.
        return hvd.broadcast_object(obj, root_rank=src, name="lightning.broadcast")

    def barrier(self, name: Optional[str] = None) -> None:
        """Returns when every rank has reached it (``name`` is only Lightning's label)."""
        hvd.barrier()

    def teardown(self) -> None:
        self._algorithms = []
        super().teardown()  # type: ignore[misc]

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """``Trainer(strategy="horovod")``, as in Lightning 1.x."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description="bagua_hvd's HorovodStrategy"
            )
