"""The rank side both frontends share: the shards, the epoch lines, the run's files in the
Store. Runs inside the ranks that ``bagua_hvd.spark.run`` starts (no Spark there)."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Tuple

from bagua_hvd.spark.common import util


def load_shards(
    s: Dict[str, Any], rank: int, size: int
) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """This rank's training shard and validation shard (None without validation data), with
    ``transformation_fn`` applied."""
    columns = [*s["feature_cols"], *s["label_cols"]]
    if s["sample_weight_col"]:
        columns.append(s["sample_weight_col"])
    columns = list(dict.fromkeys(columns))
    shards: List[Optional[Dict[str, Any]]] = []
    for path in (s["train_path"], s["val_path"]):
        if path is None:
            shards.append(None)
            continue
        data = util.read_shard(s["store"], path, columns, rank, size)
        if s["transformation_fn"] is not None:
            data = util.apply_transformation(s["transformation_fn"], data)
        shards.append(data)
    return shards[0], shards[1]  # type: ignore[return-value]


def batches(s: Dict[str, Any], data: Dict[str, Any], rank: int, train: bool) -> Any:
    seed = None if s["random_seed"] is None else s["random_seed"] + 7919 * rank
    size = s["batch_size"] if train else s["val_batch_size"]
    return iter(util.Batches(data, size, shuffle=train and s["shuffle"], seed=seed))


class Progress:
    """Rank 0's display: a line per epoch (verbose >= 1), a line per step too (verbose >= 2).
    The lines reach the driver through bagua_hvd.spark.run, prefixed ``[0]<stdout>:``."""

    def __init__(self, s: Dict[str, Any], rank: int) -> None:
        self.on = rank == 0 and s["verbose"] >= 1
        self.steps = self.on and s["verbose"] >= 2
        self.total = s["initial_epoch"] + s["epochs"]
        self.start = 0.0
        if self.on:
            print(
                f"Training: epochs {s['initial_epoch'] + 1}..{self.total}, train rows "
                f"{s['train_rows']}, val rows {s['val_rows']}, batch size {s['batch_size']} "
                f"per process, {s['steps_per_epoch']} steps per epoch",
                flush=True,
            )

    def epoch_start(self) -> None:
        self.start = time.monotonic()

    def step(self, epoch: int, step: int, steps: int, loss: float) -> None:
        if self.on and self.steps:
            print(f"epoch {epoch + 1}/{self.total} step {step + 1}/{steps} loss {loss:.4f}",
                  flush=True)  # fmt: skip

    def epoch_end(self, epoch: int, metrics: Dict[str, Any]) -> None:
        if self.on:
            took = time.monotonic() - self.start
            flat = {}
            for phase in ("train", "validation"):
                for k, v in metrics.get(phase, {}).items():
                    flat[k if phase == "train" else f"val_{k}"] = v
            print(f"epoch {epoch + 1}/{self.total}  {util.fmt_metrics(flat)}  ({took:.1f} s)",
                  flush=True)  # fmt: skip


def save_run(s: Dict[str, Any], checkpoint: bytes, history: List[Dict[str, Any]]) -> None:
    """Rank 0, after an epoch: the checkpoint, then the history (which counts the epochs a
    resume starts after)."""
    store = s["store"]
    if s["checkpoint_file"] is None:
        return
    store.write(s["checkpoint_file"], checkpoint)
    if s["logs_path"] is not None:
        store.write_text(f"{s['logs_path']}/{util.HISTORY_FILE}", json.dumps(history))
