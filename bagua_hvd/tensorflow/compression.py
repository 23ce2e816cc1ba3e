"""Gradient compression for allreduce/reducescatter (``horovod.tensorflow.compression``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from bagua_hvd.common.compression import (  # noqa: F401  (Horovod's)
    CastCompressor,
    Compressor,
    NoneCompressor,
    cast_compressors,
)


class _TFCast(CastCompressor):
    @staticmethod
    def is_floating(dtype: Any) -> bool:
        return dtype.is_floating

    @staticmethod
    def cast(tensor: tf.Tensor, dtype: Any) -> tf.Tensor:
        return tf.cast(tensor, dtype)


FP16Compressor, BF16Compressor, Compression = cast_compressors(
    _TFCast, tf.float16, tf.bfloat16, __name__
)
