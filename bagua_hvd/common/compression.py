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


class CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the collective and back afterwards;
    other tensors pass unchanged. The context is the original dtype. A frontend provides
    :meth:`is_floating` and :meth:`cast` for its tensors and dtypes."""

    wire_dtype: Any = None

    @staticmethod
    def is_floating(dtype: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> Tuple[Any, Any]:
        dtype = tensor.dtype
        if cls.is_floating(dtype) and dtype != cls.wire_dtype:
            return cls.cast(tensor, cls.wire_dtype), dtype
        return tensor, dtype

    @classmethod
    def decompress(cls, tensor: Any, ctx: Any) -> Any:
        if ctx is not None and cls.is_floating(ctx) and tensor.dtype != ctx:
            return cls.cast(tensor, ctx)
        return tensor


def cast_compressors(base: type, fp16: Any, bf16: Any, module: str) -> Tuple[type, type, type]:
    """``(FP16Compressor, BF16Compressor, Compression)`` of a frontend whose
    :class:`CastCompressor` subclass is ``base`` and whose 16-bit dtypes are ``fp16`` and
    ``bf16`` (``module``: where the classes live, for their ``__module__``)."""
    fp16_cls = type(
        "FP16Compressor",
        (base,),
        {
            "__doc__": "Casts floating-point tensors to float16 for the collective and back.",
            "__module__": module,
            "wire_dtype": fp16,
        },
    )
    bf16_cls = type(
        "BF16Compressor",
        (base,),
        {
            "__doc__": "Casts floating-point tensors to bfloat16 (float32's range, fewer "
            "mantissa bits) for the collective and back.",
            "__module__": module,
            "wire_dtype": bf16,
        },
    )
    compression = type(
        "Compression",
        (),
        {
            "__doc__": "Optional gradient compression used by allreduce and DistributedOptimizer.",
            "__module__": module,
            "none": NoneCompressor,
            "fp16": fp16_cls,
            "bf16": bf16_cls,
        },
    )
    return fp16_cls, bf16_cls, compression
