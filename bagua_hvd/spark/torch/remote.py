"""TorchEstimator's training function: runs on every rank that bagua_hvd.spark.run starts."""

from __future__ import annotations

import copy
import io
import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np


def default_train_minibatch_fn() -> Callable[..., Any]:
    """Horovod's ``train_minibatch_fn`` default: one forward and backward pass. The optimizer
    steps after every ``backward_passes_per_step``-th pass (the training loop does it)."""

    def train_minibatch(
        model: Any, optimizer: Any, transform_outputs: Any, loss_fn: Any, inputs: Any,
        labels: Any, sample_weights: Any, backward_passes_per_step: int = 1, batch_idx: int = 0,
    ) -> Any:  # fmt: skip
        if batch_idx % backward_passes_per_step == 0:
            optimizer.zero_grad()
        outputs = model(*inputs)
        outputs, labels = transform_outputs(outputs, labels)
        loss = loss_fn(outputs, labels, sample_weights)
        if backward_passes_per_step > 1:
            loss = loss / float(backward_passes_per_step)
        loss.backward()
        return outputs, loss

    return train_minibatch


def _unreduced(loss_fn: Any) -> Callable[[Any, Any], Any]:
    """``loss_fn`` giving one loss per sample: a copy of a torch loss module with
    ``reduction='none'``, or a functional loss called with ``reduction='none'`` (Horovod's)."""
    if hasattr(loss_fn, "reduction"):
        per_sample = copy.copy(loss_fn)
        per_sample.reduction = "none"
        return per_sample
    return lambda output, label: loss_fn(output, label, reduction="none")


def make_loss(loss_fns: Sequence[Any], loss_weights: Sequence[float]) -> Callable[..., Any]:
    """The weighted sum of the per-label losses; with sample weights, each sample's loss is
    scaled by its weight before the batch mean (Horovod's calculate_loss)."""
    unreduced = [_unreduced(f) for f in loss_fns]

    def loss(outputs: List[Any], labels: List[Any], sample_weights: Any = None) -> Any:
        if sample_weights is None:
            parts = [f(o, y) * w for f, o, y, w in zip(loss_fns, outputs, labels, loss_weights)]
        else:
            parts = [
                (f(o, y).flatten() * sample_weights).mean() * w
                for f, o, y, w in zip(unreduced, outputs, labels, loss_weights)
            ]
        return sum(parts)

    return loss


def make_transform_outputs(label_shapes: Optional[Sequence[Any]]) -> Callable[..., Any]:
    def transform_outputs(outputs: Any, labels: List[Any]) -> Any:
        if not isinstance(outputs, (list, tuple)):
            outputs = [outputs]
        outputs = list(outputs)
        if label_shapes:
            labels = [y.reshape(list(s)) for y, s in zip(labels, label_shapes)]
        else:  # a label with as many values per row as the output takes its shape
            labels = [
                y.reshape(o.shape) if o.shape.numel() == y.shape.numel() and o.dim() > 1 else y
                for y, o in zip(labels, outputs)
            ]
        return outputs, labels

    return transform_outputs


def _metric_name(fn: Any, i: int) -> str:
    name = getattr(fn, "__name__", None)
    return name if name and name != "<lambda>" else f"metric_{i}"


def train(
    s: Dict[str, Any],
    model: Any,
    optimizer_cls: Any,
    optimizer_state: Dict[str, Any],
    checkpoint: Optional[bytes],
    loss_fns: List[Any],
    loss_weights: List[float],
    metrics: List[Any],
    input_shapes: Optional[List[Any]],
    train_minibatch_fn: Optional[Callable[[], Any]],
) -> Any:
    """One rank of a TorchEstimator fit; rank 0 returns ``(history, checkpoint bytes)``."""
    import torch

    import bagua_hvd.torch as hvd
    from bagua_hvd.spark.common import remote, util

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))
    if s["random_seed"] is not None:
        torch.manual_seed(s["random_seed"])
    device = torch.device("cpu")
    if s["use_gpu"] and torch.cuda.is_available():
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    model = model.to(device)

    # A fresh optimizer on this model's parameters (the driver's holds the driver's tensors);
    # the checkpoint keeps the learning rate of one process: scaled by size here, as Horovod.
    optimizer = optimizer_cls(model.parameters(), lr=1)
    if checkpoint is not None:
        state = torch.load(io.BytesIO(checkpoint), map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer_state = state["optimizer"]
    optimizer_state = copy.deepcopy(optimizer_state)
    for group in optimizer_state["param_groups"]:
        group["lr"] = group["lr"] * size
    optimizer.load_state_dict(optimizer_state)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    kwargs: Dict[str, Any] = {"backward_passes_per_step": s["backward_passes_per_step"]}
    if s["gradient_compression"] is not None:
        kwargs["compression"] = s["gradient_compression"]
    if s["algorithm"] is not None:
        kwargs["algorithm"] = s["algorithm"]
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), **kwargs
    )

    train_data, val_data = remote.load_shards(s, rank, size)
    features, labels, sw_col = s["feature_cols"], s["label_cols"], s["sample_weight_col"]
    label_types = [util.label_dtype(train_data[c]) for c in labels]
    loss_fn = make_loss(loss_fns, loss_weights)
    transform_outputs = make_transform_outputs(s["label_shapes"])
    minibatch = (train_minibatch_fn or default_train_minibatch_fn)()
    bpps = s["backward_passes_per_step"]
    steps = -(-s["steps_per_epoch"] // bpps) * bpps  # whole accumulation groups
    progress = remote.Progress(s, rank)

    def tensors(batch: Dict[str, np.ndarray]) -> Any:
        x = [
            torch.from_numpy(np.ascontiguousarray(a)).to(device)
            for a in util.as_inputs(batch, features, input_shapes, np.float32)
        ]
        y = [torch.from_numpy(batch[c].astype(t)).to(device) for c, t in zip(labels, label_types)]
        w = None
        if sw_col:
            w = torch.from_numpy(batch[sw_col].astype(np.float32)).to(device)
        return x, y, w

    def averaged(name: str, totals: Dict[str, float], count: int) -> Dict[str, float]:
        keys = list(totals)  # the same order on every rank: loss, then the metrics
        values = torch.tensor([totals[k] / max(1, count) for k in keys], dtype=torch.float64)
        values = hvd.allreduce(values, name=name)  # averaged across ranks
        return {k: float(v) for k, v in zip(keys, values)}

    def measure(totals: Dict[str, float], outputs: List[Any], ys: List[Any], loss: Any) -> None:
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
        for i, fn in enumerate(metrics):
            for o, y, label in zip(outputs, ys, labels):
                key = f"{_metric_name(fn, i)}_{label}"
                totals[key] = totals.get(key, 0.0) + float(fn(o.detach(), y))

    def state_bytes() -> bytes:
        state = copy.deepcopy(optimizer.state_dict())
        for group in state["param_groups"]:
            group["lr"] = group["lr"] / size
        model_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        buffer = io.BytesIO()
        torch.save({"model": model_state, "optimizer": state}, buffer)
        return buffer.getvalue()

    history = list(s["history"])
    train_iter = remote.batches(s, train_data, rank, train=True)
    val_iter = remote.batches(s, val_data, rank, train=False) if val_data is not None else None
    first = s["initial_epoch"]
    for epoch in range(first, first + s["epochs"]):
        progress.epoch_start()
        model.train()
        totals: Dict[str, float] = {}
        for step in range(steps):
            x, y, w = tensors(next(train_iter))
            outputs, loss = minibatch(model, optimizer, transform_outputs, loss_fn, x, y, w,
                                      bpps, step)  # fmt: skip
            if (step + 1) % bpps == 0:
                optimizer.step()
            if bpps > 1:
                loss = loss * bpps  # the batch's own loss, for the display
            measure(totals, outputs, transform_outputs(outputs, y)[1], loss)
            progress.step(epoch, step, steps, float(loss.detach()))
        entry: Dict[str, Any] = {"epoch": epoch, "train": averaged("train", totals, steps)}
        if val_iter is not None and s["validation_steps"]:
            model.eval()
            totals = {}
            with torch.no_grad():
                for _ in range(s["validation_steps"]):
                    x, y, w = tensors(next(val_iter))
                    outputs, ys = transform_outputs(model(*x), y)
                    measure(totals, outputs, ys, loss_fn(outputs, ys, w))
            entry["validation"] = averaged("val", totals, s["validation_steps"])
        history.append(entry)
        progress.epoch_end(epoch, entry)
        if rank == 0:
            remote.save_run(s, state_bytes(), history)
    if rank != 0:
        return None
    return history, state_bytes()
