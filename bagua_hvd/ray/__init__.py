"""horovod.ray's RayExecutor for bagua_hvd: ``from bagua_hvd.ray import RayExecutor``."""

from bagua_hvd.ray.runner import RayExecutor

__all__ = ["RayExecutor"]
