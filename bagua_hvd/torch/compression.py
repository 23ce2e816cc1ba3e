"""Gradient compression for allreduce/reducescatter (``horovod.torch.compression``)."""

from __future__ import annotations

from typing import Any

import torch

from bagua_hvd.common.compression import (  # noqa: F401  (Horovod's)
    CastCompressor,
    Compressor,
    NoneCompressor,
    cast_compressors,
)


class _TorchCast(CastCompressor):
    @staticmethod
    def is_floating(dtype: Any) -> bool:
        return dtype.is_floating_point

    @staticmethod
    def cast(tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        return tensor.type(dtype)


FP16Compressor, BF16Compressor, Compression = cast_compressors(
    _TorchCast, torch.float16, torch.bfloat16, __name__
)
