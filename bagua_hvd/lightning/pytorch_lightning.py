"""``HorovodStrategy`` for the standalone ``pytorch_lightning`` package (``import
pytorch_lightning as pl``): the same strategy as ``bagua_hvd.lightning.HorovodStrategy`` (see its
docstring and docs/lightning.md), built on that package's own base classes, which its Trainer
requires.

    import pytorch_lightning as pl
    from bagua_hvd.lightning.pytorch_lightning import HorovodStrategy

    trainer = pl.Trainer(strategy=HorovodStrategy(), accelerator="cpu", devices=1)
"""

from __future__ import annotations

from bagua_hvd.lightning import _core
from bagua_hvd.lightning._package import require

_environments = require("lightning_fabric", "pytorch-lightning", "plugins.environments")
_strategies = require("pytorch_lightning", "pytorch-lightning", "strategies")

__all__ = ["HorovodEnvironment", "HorovodStrategy"]


class HorovodEnvironment(_core.EnvironmentMixin, _environments.ClusterEnvironment):
    """``bagua_hvd.lightning.HorovodEnvironment`` for pytorch_lightning."""


class HorovodStrategy(_core.StrategyMixin, _strategies.ParallelStrategy):
    """``bagua_hvd.lightning.HorovodStrategy`` for pytorch_lightning's Trainer (same arguments
    and behaviour)."""

    environment_class = HorovodEnvironment


HorovodStrategy.register_strategies(_strategies.StrategyRegistry)
