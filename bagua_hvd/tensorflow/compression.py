"""Gradient compression for allreduce/reducescatter (``horovod.tensorflow.compression``)."""

from __future__ import annotations

from typing import Any, Tuple

import tensorflow as tf

from bagua_hvd.common.compression import Compressor, NoneCompressor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the collective and back afterwards;
    other tensors pass unchanged. The context is the original dtype."""

    wire_dtype: tf.DType

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != cls.wire_dtype:
            return tf.cast(tensor, cls.wire_dtype), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        if ctx is not None and ctx.is_floating and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Casts floating-point tensors to float16 for the collective and back afterwards."""

    wire_dtype = tf.float16


class BF16Compressor(_CastCompressor):
    """Casts floating-point tensors to bfloat16 (float32's range, fewer mantissa bits)."""

    wire_dtype = tf.bfloat16


class Compression:
    """Optional gradient compression used by allreduce and (later) DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
