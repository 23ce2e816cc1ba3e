"""Gradient compression for allreduce/reducescatter (``horovod.torch.compression``)."""

from __future__ import annotations

from typing import Any, Tuple

import torch


class Compressor:
    """Interface for compressing and decompressing a tensor around a collective."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompresses the tensor with the given context."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Default: no compression."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Casts floating-point tensors to float16 for the collective and back afterwards."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        tensor_compressed = tensor
        if tensor.dtype.is_floating_point:
            tensor_compressed = tensor.type(torch.float16)
        return tensor_compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        dtype = ctx
        tensor_decompressed = tensor
        if dtype.is_floating_point:
            tensor_decompressed = tensor.type(dtype)
        return tensor_decompressed


class BF16Compressor(Compressor):
    """Casts floating-point tensors to bfloat16 (float32's range, fewer mantissa bits)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        tensor_compressed = tensor
        if tensor.dtype.is_floating_point:
            tensor_compressed = tensor.type(torch.bfloat16)
        return tensor_compressed, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        dtype = ctx
        tensor_decompressed = tensor
        if dtype.is_floating_point:
            tensor_decompressed = tensor.type(dtype)
        return tensor_decompressed


class Compression:
    """Optional gradient compression used by allreduce and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
