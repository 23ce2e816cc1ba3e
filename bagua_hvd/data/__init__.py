"""Horovod's ``horovod.data``: the data loader interface (``BaseDataLoader``) and the mixin that
loads its batches in a background thread (``AsyncDataLoaderMixin``)."""

from bagua_hvd.data.data_loader_base import AsyncDataLoaderMixin, BaseDataLoader

__all__ = ["AsyncDataLoaderMixin", "BaseDataLoader"]
