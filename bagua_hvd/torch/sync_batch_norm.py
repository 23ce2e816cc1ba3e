"""Synchronous batch normalization (``horovod.torch.sync_batch_norm``), on CPU and CUDA tensors.

In training mode the batch statistics are those of the batch concatenated over every rank:

* forward: each rank computes, per channel, its element count, mean and sum of squared
  deviations (``M2``) and sends them in ONE allgather (``sync_batch_norm.stats``, float64,
  ``2 * C + 1`` values per rank); every rank combines them with Chan's parallel-variance
  formula, which unlike an allreduce of sums and sums of squares does not cancel
  catastrophically when the mean is large against the deviation. Uneven per-rank batches (even
  empty ones) weigh by their counts.
* backward: ONE allreduce (Sum, ``sync_batch_norm.grad``, float64) of the per-channel
  ``sum(dy)`` and ``sum(dy * (x - mean))`` gives the input gradient of the global batch.
  Weight and bias gradients stay local (this rank's share), as in Horovod and
  ``torch.nn.SyncBatchNorm``: the DistributedOptimizer's allreduce combines them.
* running statistics are updated like ``torch.nn.BatchNorm``'s with the global batch: the
  global mean and the unbiased global variance, with ``momentum`` (or the cumulative average
  when ``momentum`` is None).

Statistics are accumulated in float32 for float16/bfloat16/float32 inputs (float64 for
float64 inputs). With ``size() == 1``, in eval mode with running statistics, the layer is plain
``torch.nn.functional.batch_norm``. Unlike Horovod's, which raises
``ValueError('SyncBatchNorm expected input tensor to be on GPU')`` for CPU tensors, this one
runs on CPU (and CUDA) tensors.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import Function
from torch.nn.modules.batchnorm import _BatchNorm

from bagua_hvd.torch.mpi_ops import Sum, allgather, allreduce, size

__all__ = ["SyncBatchNorm"]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _reduce_dims(t: torch.Tensor) -> List[int]:
    return [0] + list(range(2, t.dim()))


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A (C,) tensor shaped to broadcast against an (N, C, ...) tensor."""
    return v.view([1, -1] + [1] * (like.dim() - 2))


class _SyncBatchNorm(Function):
    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        running_mean: Optional[torch.Tensor],
        running_var: Optional[torch.Tensor],
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        channels = input.size(1)
        acc = _acc_dtype(input)
        x = input.to(acc)
        dims = _reduce_dims(x)
        count = input.numel() // channels if channels else 0

        # Local count, mean and M2 per channel, in one float64 message.
        if count > 0:
            var_l, mean_l = torch.var_mean(x, dim=dims, correction=0)
            m2_l = var_l * count
        else:
            mean_l = torch.zeros(channels, dtype=acc, device=x.device)
            m2_l = torch.zeros(channels, dtype=acc, device=x.device)
        local = torch.empty(1, 2 * channels + 1, dtype=torch.float64, device=x.device)
        local[0, 0] = count
        local[0, 1 : channels + 1] = mean_l
        local[0, channels + 1 :] = m2_l
        gathered = allgather(local, name="sync_batch_norm.stats")

        counts = gathered[:, :1]
        total = float(counts.sum().item())
        if total <= 1:
            raise ValueError(
                "Expected more than 1 value per channel when training, got input size "
                f"{tuple(input.shape)} (a global batch of {int(total)} value(s) per channel)"
            )
        means = gathered[:, 1 : channels + 1]
        m2s = gathered[:, channels + 1 :]
        mean64 = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean64) ** 2).sum(0)
        var64 = m2 / total
        invstd64 = torch.rsqrt(var64 + eps)

        if running_mean is not None:
            running_mean.mul_(1.0 - momentum).add_(mean64.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = (m2 / (total - 1)).to(running_var.dtype)
            running_var.mul_(1.0 - momentum).add_(unbiased, alpha=momentum)

        mean = mean64.to(acc)
        invstd = invstd64.to(acc)
        scale = invstd if weight is None else invstd * weight.to(acc)
        out = (x - _per_channel(mean, x)) * _per_channel(scale, x)
        if bias is not None:
            out = out + _per_channel(bias.to(acc), x)

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total = total
        ctx.has_bias = bias is not None
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[0:3]
        acc = mean.dtype
        x = input.to(acc)
        dy = grad_output.to(acc)
        dims = _reduce_dims(x)
        xmu = x - _per_channel(mean, x)
        if x.numel():
            sum_dy = dy.sum(dims)
            sum_dy_xmu = (dy * xmu).sum(dims)
        else:
            sum_dy = torch.zeros_like(mean)
            sum_dy_xmu = torch.zeros_like(mean)

        grad_input = grad_weight = grad_bias = None
        if weight is not None and need_weight:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if ctx.has_bias and need_bias:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else grad_output.dtype)

        if need_input:
            channels = mean.numel()
            packed = torch.cat([sum_dy, sum_dy_xmu]).to(torch.float64)
            reduced = allreduce(packed, op=Sum, name="sync_batch_norm.grad")
            mean_dy = (reduced[:channels] / ctx.total).to(acc)
            mean_dy_xmu = (reduced[channels:] / ctx.total).to(acc)
            scale = invstd if weight is None else invstd * weight.to(acc)
            grad = (
                dy - _per_channel(mean_dy, x) - xmu * _per_channel(invstd * invstd * mean_dy_xmu, x)
            )
            grad_input = (grad * _per_channel(scale, x)).to(input.dtype)

        return grad_input, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Applies synchronous version of N-dimensional BatchNorm.

    In this version, normalization parameters are synchronized across workers during forward
    pass. This is very useful in situations where each GPU can fit a very small number of
    examples.

    See https://pytorch.org/docs/stable/nn.html#batchnorm2d for more details about BatchNorm.

    Arguments:
        num_features: number of channels `C` from the shape `(N, C, ...)`.
        eps: a value added to the denominator for numerical stability. Default: 1e-5.
        momentum: the value used for the running_mean and running_var computation. Can be set
            to `None` for cumulative moving average (i.e. simple average). Default: 0.1.
        affine: a boolean value that when set to `True`, this module has learnable affine
            parameters. Default: `True`.
        track_running_stats: a boolean value that when set to `True`, this module tracks the
            running mean and variance, and when set to `False`, this module does not track such
            statistics and always uses batch statistics in both training and eval modes.
            Default: `True`.

    .. note:: Only the statistics are synchronized: the weight and bias gradients are this
       rank's share, to be combined by ``DistributedOptimizer`` (as in Horovod). Works on CPU
       and CUDA tensors; inputs are `(N, C)`, `(N, C, L)`, `(N, C, H, W)` or `(N, C, D, H, W)`,
       and ranks may have different batch sizes.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)

        # As torch.nn.modules.batchnorm._BatchNorm.forward.
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
            else:  # exponential moving average
                exponential_average_factor = self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_running = not self.training or self.track_running_stats
        running_mean = self.running_mean if use_running else None
        running_var = self.running_var if use_running else None

        if not bn_training or size() == 1:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                exponential_average_factor,
                self.eps,
            )
        return _SyncBatchNorm.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            exponential_average_factor,
        )

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Returns ``module`` with every ``torch.nn.modules.batchnorm._BatchNorm`` layer
        (BatchNorm1d/2d/3d, ...) replaced by a SyncBatchNorm sharing its parameters and buffers.

        Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` (without ``process_group``).
        """
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child))
        return out
