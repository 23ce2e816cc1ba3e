"""``HorovodStrategy`` for Lightning 2's ``lightning.pytorch`` (``import lightning as L``).

    import lightning as L
    from bagua_hvd.lightning import HorovodStrategy
    from bagua_hvd.torch.algorithms import ByteGrad

    trainer = L.Trainer(strategy=HorovodStrategy(algorithm=ByteGrad()), accelerator="cpu",
                        devices=1)
    trainer.fit(model)               # bagua-run -np 4 python train.py

docs/lightning.md says what is supported. The behaviour is in ``bagua_hvd/lightning/_core.py``
(shared with ``bagua_hvd.lightning.pytorch_lightning``).
"""

from __future__ import annotations

from bagua_hvd.lightning import _core
from bagua_hvd.lightning._package import require

_environments = require("lightning.fabric", "lightning", "plugins.environments")
_strategies = require("lightning.pytorch", "lightning", "strategies")

AlgorithmArg = _core.AlgorithmArg

__all__ = ["HorovodEnvironment", "HorovodStrategy"]


class HorovodEnvironment(_core.EnvironmentMixin, _environments.ClusterEnvironment):
    """Lightning's view of a bagua_hvd job: the ranks the launcher gave (``hvd.rank()``,
    ``hvd.size()``, ``hvd.local_rank()``, ``hvd.cross_rank()`` as the node rank); Lightning starts
    no process. HorovodStrategy uses it by default."""


class HorovodStrategy(_core.StrategyMixin, _strategies.ParallelStrategy):
    """Data-parallel training over a bagua_hvd job, with BAGUA's algorithms:
    ``Trainer(strategy=HorovodStrategy(algorithm=...), devices=1)`` in every process that
    ``bagua-run -np N`` (or mpirun, srun, Ray's RayExecutor, ...) starts; Lightning starts none.

    What it does (Lightning 1.x's HorovodStrategy, plus ``algorithm=``):

    - ``hvd.init()`` when built; ranks, world size and Lightning's rank-zero-only helpers are
      bagua_hvd's; each rank trains on the CPU or on its local rank's GPU;
    - when fitting: the learning rates are multiplied by the number of ranks (``scale_lr``),
      rank 0's parameters, buffers and optimizer state are broadcast to every rank, and each
      optimizer is wrapped in ``bagua_hvd.torch.DistributedOptimizer`` with ``algorithm`` and
      ``backward_passes_per_step`` = ``Trainer(accumulate_grad_batches=...)``; the gradients
      are averaged (or the weights averaged, as the algorithm says) before the update, and
      before gradient clipping;
    - each rank reads its part of the data (``DistributedSampler(num_replicas=size, rank=rank)``,
      put in by Lightning);
    - ``reduce`` (``self.log(..., sync_dist=True)``), ``all_gather``, ``broadcast`` and
      ``barrier`` run over every rank; checkpoints are written by rank 0 only and read by every
      rank (a resumed fit continues rank 0's state on every rank);
    - ``Trainer(strategy="horovod")`` names it once this module is imported.

    Arguments:
        algorithm: how gradients (or weights) are communicated. None (default):
            ``bagua-run --algorithm NAME`` (``BAGUA_HVD_ALGORITHM``) if set, else Horovod's
            gradient allreduce. An object of ``bagua_hvd.torch.algorithms`` (``ByteGrad()``,
            ``Decentralized()``, ``LowPrecisionDecentralized()``, ``AsyncModelAverage()``,
            ``GradientAllReduce()``, ``Auto([...])``) for a module with one optimizer;
            ``"auto"``; or a callable ``optimizer -> algorithm`` called for each optimizer (QAdam:
            ``lambda opt: QAdamAlgorithm(opt)`` with a ``QAdamOptimizer`` from
            ``configure_optimizers``). Asynchronous model averaging stops when the fit ends.
        scale_lr: multiply every param group's ``lr`` (and ``initial_lr``) and every scheduler's
            ``base_lrs`` by the number of ranks when fitting starts, as Lightning 1.x's
            HorovodStrategy did. Default: True. A resumed fit takes the rates from the checkpoint.
        optimizer_kwargs: further arguments of ``DistributedOptimizer`` for every optimizer
            (``compression``, ``op``, ``gradient_predivide_factor``, ``groups``,
            ``sparse_as_dense``, ...). Default: None.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            Lightning's (``cluster_environment`` defaults to :class:`HorovodEnvironment`).
    """

    environment_class = HorovodEnvironment


HorovodStrategy.register_strategies(_strategies.StrategyRegistry)
