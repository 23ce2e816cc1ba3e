"""The framework-neutral part of Horovod's gradient compression: the ``Compressor`` interface
users subclass and the no-op compressor. The casting compressors are per framework
(``bagua_hvd.torch.compression``, ``bagua_hvd.tensorflow.compression``)."""

from __future__ import annotations

from typing import Any, Tuple


class Compressor:
    """Interface for compressing and decompressing a tensor around a collective."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Decompresses the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: no compression."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor
