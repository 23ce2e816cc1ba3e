"""bagua_hvd.lightning.HorovodStrategy in real 2-rank jobs started by the launcher.

Two jobs of tests/workers/lightning_worker.py's and examples/lightning/digits.py's (Lightning's
import is the costly part, so each job checks several things):

- the strategy's collectives against numbers computed by hand (in the worker);
- a fit with Decentralized(shift_one): each rank's final weights are those of
  tests/reference_algorithms.py replaying the rank's batches from the broadcast initial weights,
  the ranks' weights differ, each rank trained on the DistributedSampler part torch gives it,
  and only rank 0 wrote checkpoints (holding rank 0's weights);
- a fit with accumulate_grad_batches=2: gradient allreduce of the mean gradient of each pair of
  batches (the reference's step on the pair joined), one step per pair;
- the same with a GradientAccumulationScheduler (1 batch per step, then 2);
- a fit with manual optimization: the reference's gradient allreduce, one step per batch;
- the same strategy for the standalone pytorch_lightning package;
- the digits example: accuracy >= 0.95 with equal replicas, then a second job resuming from the
  checkpoint of epoch 2, which continues the counters and ends with the weights of the
  uninterrupted run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "lightning",
    reason="Lightning 2 is not installed: pip install 'bagua_hvd[lightning]' (in the test extra)",
)
pytest.importorskip("sklearn", reason="the Lightning tests train on scikit-learn's digits")

import reference_algorithms as ra  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_examples import assert_same_weights, launcher, run  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "lightning_worker.py"
DIGITS = ROOT / "examples" / "lightning" / "digits.py"
RANKS = 2
EPOCHS = 6  # of the digits example; the resumed job starts after the second
# The worker's settings (tests/workers/lightning_worker.py).
LR, MOMENTUM, SAMPLES, BATCH, SAMPLER_SEED, INIT_SEED = 0.05, 0.9, 192, 16, 7, 100
TIMEOUT_S = 300


def worker_net() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))


@pytest.fixture(scope="module")
def worker(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("lightning")
    proc = run([*launcher(), "-np", str(RANKS), sys.executable, str(WORKER), str(out)])
    return proc.stdout + proc.stderr, out


def records(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(RANKS)]


def loss_fn(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch[0], batch[1]
    return F.cross_entropy(model(x), y)


def sgd(params) -> torch.optim.Optimizer:
    # The strategy scales the learning rate by the number of ranks (scale_lr=True).
    return torch.optim.SGD(params, lr=LR * RANKS, momentum=MOMENTUM)


def from_state(state: dict) -> torch.nn.Module:
    net = worker_net()
    net.load_state_dict(state)
    return net


def assert_params(got: dict, want: list[torch.Tensor], what: str, rtol: float = 1e-5) -> None:
    got_list = list(got.values())  # state_dict order: registration order, as want's
    assert len(got_list) == len(want), what
    for i, (a, b) in enumerate(zip(got_list, want)):
        scale = b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err <= rtol * max(scale, 1e-12), f"{what}: parameter {i} off by {err:.3g}"


def assert_follows_reference(
    recs: list[dict], algorithm: str, batches: list[list], **alg_kwargs
) -> None:
    """Each rank's final weights are those of tests/reference_algorithms.py running
    ``algorithm`` over ``batches[rank]`` from the weights the job started from."""
    steps = len(batches[0])
    assert all(len(b) == steps for b in batches)
    want = ra.run_reference(
        algorithm,
        RANKS,
        lambda r: from_state(recs[0]["initial"]),
        batches,
        loss_fn,
        sgd,
        steps,
        **alg_kwargs,
    )
    for r, rec in enumerate(recs):
        assert_params(rec["final"], want.params[r], f"{algorithm}: rank {r}")


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_collectives_give_the_numbers(worker):
    text, _ = worker
    for r in range(RANKS):
        assert f"rank {r}: collectives ok" in text, text


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_decentralized_fit_follows_the_reference(worker):
    text, out = worker
    assert all(f"rank {r}: decentralized ok" in text for r in range(RANKS)), text
    recs = records(out, "decentralized")
    # The strategy broadcast rank 0's initial weights (the ranks were seeded differently).
    with torch.random.fork_rng():
        torch.manual_seed(INIT_SEED)
        rank0_init = worker_net().state_dict()
    for rec in recs:
        assert_same_weights(rec["initial"], rank0_init, rtol=0)
    assert len(recs[0]["batches"]) == 2 * SAMPLES // RANKS // BATCH
    batches = [rec["batches"] for rec in recs]
    assert_follows_reference(recs, "decentralized", batches, peer_selection_mode="shift_one")
    # Decentralized SGD keeps a model per rank: they differ (the local step follows the average).
    assert any(not torch.equal(a, b) for a, b in zip(*(rec["final"].values() for rec in recs)))


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_each_rank_trains_on_its_distributed_sampler_part(worker):
    _, out = worker
    from torch.utils.data import DistributedSampler

    for name in ("decentralized", "accumulate", "accumulate_schedule", "manual"):
        for r, rec in enumerate(records(out, name)):
            seen = torch.cat([b[2] for b in rec["batches"]]).tolist()
            want = []
            for epoch in range(2):  # every fit of the worker runs 2 epochs
                sampler = DistributedSampler(
                    range(SAMPLES), num_replicas=RANKS, rank=r, shuffle=True, seed=SAMPLER_SEED
                )
                sampler.set_epoch(epoch)
                want += list(sampler)
            assert seen == want, f"{name}: rank {r} trained on other samples"


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_checkpoints_are_written_by_rank_zero_only(worker):
    text, out = worker
    writes = re.findall(r"rank (\d+) writes (\S+)", text)
    assert sorted(writes) == [("0", "epoch=0.ckpt"), ("0", "epoch=1.ckpt")], writes
    files = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert files == ["epoch=0.ckpt", "epoch=1.ckpt"], files
    # What rank 0 had at the end, not rank 1 (decentralized: they differ).
    saved = torch.load(out / "checkpoints" / "epoch=1.ckpt", weights_only=False)
    final = [rec["final"] for rec in records(out, "decentralized")]
    weights = {k.removeprefix("net."): v for k, v in saved["state_dict"].items()}
    assert_same_weights(weights, final[0], rtol=0)
    assert saved["epoch"] == 1 and saved["global_step"] == 2 * SAMPLES // RANKS // BATCH


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_accumulated_batches_make_one_allreduced_step(worker):
    """accumulate_grad_batches=2: DistributedOptimizer(backward_passes_per_step=2); Lightning
    divides each loss by 2, so a step applies the average over ranks of the mean gradient of
    two batches: the reference's step on the two batches joined."""
    text, out = worker
    assert all(f"rank {r}: accumulate ok" in text for r in range(RANKS)), text
    recs = records(out, "accumulate")
    pairs = [joined_pairs(rec["batches"]) for rec in recs]
    assert len(pairs[0]) == len(recs[0]["batches"]) // 2 == 6
    assert_follows_reference(recs, "gradient_allreduce", pairs)
    assert_same_weights(recs[0]["final"], recs[1]["final"], rtol=0)


def joined_pairs(batches: list) -> list:
    """Batches 0 and 1 joined, 2 and 3, ...: what one step over two accumulated batches sees."""
    return [
        tuple(torch.cat([a[i], b[i]]) for i in range(2))
        for a, b in zip(batches[0::2], batches[1::2])
    ]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_a_changing_accumulation_is_followed(worker):
    """GradientAccumulationScheduler({0: 1, 1: 2}): a step per batch in the first epoch, per
    pair of batches in the second (backward_passes_per_step follows)."""
    text, out = worker
    assert all(f"rank {r}: accumulate_schedule ok" in text for r in range(RANKS)), text
    recs = records(out, "accumulate_schedule")
    per_epoch = SAMPLES // RANKS // BATCH
    steps = [rec["batches"][:per_epoch] + joined_pairs(rec["batches"][per_epoch:]) for rec in recs]
    assert len(steps[0]) == per_epoch + per_epoch // 2
    assert_follows_reference(recs, "gradient_allreduce", steps)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_manual_optimization_steps_on_allreduced_gradients(worker):
    """automatic_optimization = False: the module's own opt.step() runs through the strategy
    (Horovod's allreduce, then the update), one step per batch."""
    text, out = worker
    assert all(f"rank {r}: manual ok" in text for r in range(RANKS)), text
    recs = records(out, "manual")
    assert len(recs[0]["batches"]) == 2 * SAMPLES // RANKS // BATCH
    assert_follows_reference(recs, "gradient_allreduce", [rec["batches"] for rec in recs])


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_pytorch_lightning_package(worker):
    text, out = worker
    if "pytorch_lightning skipped" in text:
        pytest.skip("the standalone pytorch_lightning package is not installed")
    assert all(f"rank {r}: pytorch_lightning ok" in text for r in range(RANKS)), text
    recs = records(out, "pytorch_lightning")
    assert_same_weights(recs[0]["final"], recs[1]["final"], rtol=0)
    assert not torch.equal(recs[0]["final"]["0.weight"], recs[0]["initial"]["0.weight"])


# ---- the digits example ------------------------------------------------------------------------
ACCURACY_RE = re.compile(r"final test accuracy: (\d+\.\d+)")
EPOCH_RE = re.compile(r"epoch +(\d+)  train loss")


def digits(*args: str) -> subprocess.CompletedProcess:
    return run(
        [*launcher(), "-np", str(RANKS), sys.executable, str(DIGITS), "--no-progress", *args]
    )


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("digits")
    return digits("--epochs", str(EPOCHS), "--output-dir", str(out)), out


def checkpoint(out: Path, epoch: int) -> dict:
    """The checkpoint of the epoch-th epoch (Lightning numbers epochs from 0)."""
    return torch.load(out / "checkpoints" / f"digits-epoch={epoch - 1}.ckpt", weights_only=False)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_digits_example_learns_with_equal_replicas(digits_run):
    proc, out = digits_run
    text = proc.stdout
    assert f"starting at epoch 1 (global step 0) on {RANKS} rank(s)" in text, text
    assert [int(e) for e in EPOCH_RE.findall(text)] == list(range(1, EPOCHS + 1)), text
    assert "max parameter difference between replicas: 0" in text, text
    accuracy = float(ACCURACY_RE.findall(text)[-1])
    assert accuracy >= 0.95, text
    files = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert files == [f"digits-epoch={e}.ckpt" for e in range(EPOCHS)], files
    logs = list((out / "logs").rglob("metrics.csv"))
    assert len(logs) == 1, logs  # rank 0's CSV log only


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
def test_digits_example_resumes_from_a_checkpoint(digits_run, tmp_path):
    """Every rank reads the checkpoint of epoch 2: the job continues from epoch 3 and its step
    count, and ends with the weights of the uninterrupted job."""
    first, first_out = digits_run
    resumed = digits(
        "--epochs", str(EPOCHS), "--output-dir", str(tmp_path),
        "--resume", str(first_out / "checkpoints" / "digits-epoch=1.ckpt"),
    )  # fmt: skip
    text = resumed.stdout
    after_two = checkpoint(first_out, 2)
    assert f"starting at epoch 3 (global step {after_two['global_step']})" in text, text
    assert [int(e) for e in EPOCH_RE.findall(text)] == list(range(3, EPOCHS + 1)), text
    assert "max parameter difference between replicas: 0" in text, text
    whole, again = checkpoint(first_out, EPOCHS), checkpoint(tmp_path, EPOCHS)
    assert again["epoch"] == whole["epoch"] and again["global_step"] == whole["global_step"]
    assert_same_weights(again["state_dict"], whole["state_dict"])
    assert float(ACCURACY_RE.findall(text)[-1]) >= 0.95, text
