"""PyTorch Lightning 2 on bagua_hvd: ``Trainer(strategy=HorovodStrategy(algorithm=...))``.

    from bagua_hvd.lightning import HorovodStrategy   # for lightning.pytorch
    from bagua_hvd.lightning.pytorch_lightning import HorovodStrategy   # for pytorch_lightning

Lightning is an optional dependency (``pip install 'bagua_hvd[lightning]'``): this package
imports it when ``HorovodStrategy`` or ``HorovodEnvironment`` is first used, and then raises
ModuleNotFoundError saying what to install if it is missing. docs/lightning.md says what is
supported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HorovodEnvironment", "HorovodStrategy"]


def __getattr__(name: str) -> Any:
    # Lazily: bagua_hvd.lightning.pytorch_lightning must import without the `lightning` package.
    if name in __all__:
        from bagua_hvd.lightning import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
