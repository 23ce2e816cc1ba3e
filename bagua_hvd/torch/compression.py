"""Gradient compression for allreduce/reducescatter (``horovod.torch.compression``)."""

from __future__ import annotations

from typing import Any, Tuple

import torch

from bagua_hvd.common.compression import Compressor, NoneCompressor


class _CastCompressor(Compressor):
    """Casts floating-point tensors to ``wire_dtype`` for the collective and back afterwards;
    other tensors pass unchanged. The context is the original dtype."""

    wire_dtype: torch.dtype

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.wire_dtype), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    """Casts floating-point tensors to float16 for the collective and back afterwards."""

    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """Casts floating-point tensors to bfloat16 (float32's range, fewer mantissa bits)."""

    wire_dtype = torch.bfloat16


class Compression:
    """Optional gradient compression used by allreduce and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
