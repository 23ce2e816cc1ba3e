"""horovod.ray for bagua_hvd: ``from bagua_hvd.ray import RayExecutor, ElasticRayExecutor``."""

from bagua_hvd.ray.discovery import RayHostDiscovery
from bagua_hvd.ray.elastic import ElasticRayExecutor
from bagua_hvd.ray.runner import RayExecutor

__all__ = ["ElasticRayExecutor", "RayExecutor", "RayHostDiscovery"]
