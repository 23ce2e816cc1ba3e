"""algorithm="auto" (docs/algorithms.md, "Auto") in an elastic torch job through the real
launcher: the choice is made, then the job is reset for real (a host joins, or a worker is
killed), and every rank, a new one included, keeps the choice without measuring again.

The job is tests/workers/elastic_torch_main.py (hvd.elastic.run, TorchState, a commit per
batch, 10 batches per epoch) with two candidates, 2 warm-up steps, 2 rounds of 3 measured steps
per candidate (``Auto``'s defaults), one candidate made 100 ms slower per step by the test hook.
By the documented schedule, steps 0 to 5 run the first candidate, 6 to 9 the second, 10 to 13
the first, 14 to 17 the second, and the choice runs from step 18 (epoch 1, batch 8).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mp_runner import needs_core
from test_elastic import _explain, _replay, _run

torch = pytest.importorskip("torch")
import reference_algorithms as ra  # noqa: E402

pytestmark = needs_core

DECISION = 2 + 2 * 2 * (3 + 1)  # the first step of the chosen candidate (docs/algorithms.md)
# Steps 0-17, (candidate, final): warm-up, then two rounds of each candidate's 1 + 3 steps.
MEASURING = [[c, False] for c in [0] * 2 + ([0] * 4 + [1] * 4) * 2]
MEASURED = 2 * 2 * 3  # steps a rank measures (rounds x candidates x steps per candidate)
# The default candidates (GradientAllReduce, ByteGrad), ByteGrad slow.
ENV = {"BAGUA_HVD_ALGORITHM": "auto", "BAGUA_HVD_TEST_ALGORITHM_DELAY": "ByteGrad:0.1"}
JOIN = [(0, ["localhost:2"]), (1, ["localhost:2"]), (None, ["localhost:2", "127.0.0.1:1"])]


def _auto_lines(tmp: Path, rank: int) -> dict[int, dict]:
    """The worker's per-epoch lines of rank ``rank`` (at the time of writing), by epoch."""
    rows = (tmp / f"log.jsonl.auto.{rank}").read_text().splitlines()
    return {row["epoch"]: row for row in map(json.loads, rows)}


def _run_join(tmp: Path, env: dict, *worker_args: str) -> tuple:
    """The job of two workers on localhost joined by a third host after epoch 1; checks that
    it ran epochs 0 and 1 at 2 ranks, epoch 2 at 3."""
    # Rank 0 waits (up to 60 s, not the default 10: a loaded machine) for the new host after
    # epoch 1, so the job resets then, whatever the load.
    proc, lines = _run(tmp, np=2, min_np=2, max_np=3, schedule=JOIN, env=env,
                       worker_args=("--discovery-wait", "60", *worker_args))  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 2, 1), (1, 2, 1), (2, 3, 2),
    ], _explain(proc)  # fmt: skip
    return proc, lines


def _check_first_epochs(
    out: str, auto: dict[int, dict[int, dict]], ranks: range, chosen: int, name: str
) -> None:
    """Epochs 0 and 1 of the workers from the start (``ranks``): the measurement, then the
    choice of candidate ``chosen`` (``name``) from step 18, printed once."""
    assert out.count("bagua_hvd auto: chose") == 1, out
    assert f"bagua_hvd auto: chose {name} from step {DECISION}" in out, out
    for r in ranks:
        assert auto[r][0]["steps"] == MEASURING[:10], auto[r][0]
        assert auto[r][1]["steps"] == MEASURING[10:] + [[chosen, True]] * 2, auto[r][1]
        assert (auto[r][1]["chosen"], auto[r][1]["chosen_step"]) == (chosen, DECISION)
        assert auto[r][1]["measured"] == MEASURED, auto[r][1]


def _check_last_epoch(
    auto: dict[int, dict[int, dict]], size: int, chosen: int, new: tuple = ()
) -> None:
    """Epoch 2, after the reset, on every rank (``new``: the ranks that joined): the chosen
    candidate at every step, the choice's step from rank 0, nothing measured since the first
    epochs' 2 x 2 x 3 steps (on a new rank: nothing)."""
    for r in range(size):
        row = auto[r][2]
        assert row["size"] == size, row
        assert row["steps"] == [[chosen, True]] * 10, row
        assert (row["chosen"], row["chosen_step"]) == (chosen, DECISION), row
        assert row["measured"] == (0 if r in new else MEASURED), row


def test_auto_choice_survives_a_host_joining(tmp_path: Path) -> None:
    """Two workers on localhost choose GradientAllReduce at step 18 (epoch 1); after epoch 1 a
    third host appears and the job resets to 3 ranks. In epoch 2 every rank, the new worker
    (rank 2) included, runs the chosen GradientAllReduce at every step, with the step count
    taken from rank 0, and measures nothing. The weights after epoch 2 are the same on every
    rank and equal an independent replay (SGD on the gradient averaged over the 3 ranks) from
    those logged after epoch 1."""
    proc, lines = _run_join(tmp_path, ENV)
    auto = {r: _auto_lines(tmp_path, r) for r in range(3)}
    _check_first_epochs(proc.stdout, auto, range(2), 0, "GradientAllReduce")
    assert sorted(auto[2]) == [2], auto[2]  # the new worker ran epoch 2 only
    _check_last_epoch(auto, 3, 0, new=(2,))
    assert all(auto[r][2]["step"] == 30 for r in range(3)), auto  # rank 0's count
    assert all(auto[r][2]["params"] == lines[2]["params"] for r in range(3)), auto
    _replay(lines[2:], init=lines[1]["params"], first_epoch=2)


def test_auto_choice_survives_a_worker_killed(tmp_path: Path) -> None:
    """Three workers on two hosts choose GradientAllReduce at step 18; the one on 127.0.0.1
    (start rank 2) is killed before batch 3 of epoch 2: the two others restore the commit after
    batch 2 (its optimizer state holds the choice) and go on at size 2 with the chosen
    GradientAllReduce, measuring nothing. The weights after epoch 2 equal the replay from epoch
    1's at sizes [3, 3, 3, 2, ...]: the failed step rolled back, not applied twice or lost."""
    proc, lines = _run(tmp_path, np=3, min_np=2, max_np=3, env=ENV,
                       schedule=[(None, ["localhost:2", "127.0.0.1:1"])],
                       exit_schedule={(2, 3): [2]}, exit_mode="kill")  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 3, 1), (1, 3, 1), (2, 2, 2),
    ], _explain(proc)  # fmt: skip
    assert lines[2]["sizes"] == [3] * 3 + [2] * 7, lines[2]
    auto = {r: _auto_lines(tmp_path, r) for r in range(3)}
    _check_first_epochs(proc.stdout, auto, range(3), 0, "GradientAllReduce")
    _check_last_epoch(auto, 2, 0)
    assert all(auto[r][2]["params"] == lines[2]["params"] for r in range(2)), auto
    _replay(lines[2:], init=lines[1]["params"], first_epoch=2)


def _sample(rank: int, epoch: int, batch: int) -> tuple:
    """The worker's batch of ``rank`` (x, y = the row sums), float32."""
    g = torch.Generator().manual_seed(100000 * rank + 1000 * epoch + batch)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def test_auto_decentralized_choice_survives_a_host_joining(tmp_path: Path) -> None:
    """``Auto([GradientAllReduce(), Decentralized(peer_selection_mode="shift_one",
    communication_interval=2, hierarchical=False)])``, GradientAllReduce slow: the two workers
    choose the decentralized SGD at step 18; the same host joins after epoch 1. After the reset
    (the sync gives every rank rank 0's weights) every rank, the new one included, runs it at
    every step with its step count continued from rank 0's (2 steps since the choice, 12 at the
    end), so the steps that average and the shift_one pairs go on; each rank's weights after
    epoch 2 equal tests/reference_algorithms.py's decentralized SGD of 3 ranks from rank 0's
    weights after epoch 1, from step 6 of its count."""
    env = {"BAGUA_HVD_TEST_ALGORITHM_DELAY": "GradientAllReduce:0.1"}
    proc, lines = _run_join(tmp_path, env, "--auto-decentralized")
    auto = {r: _auto_lines(tmp_path, r) for r in range(3)}
    _check_first_epochs(proc.stdout, auto, range(2), 1, "Decentralized")
    assert all(auto[r][1]["impl_step"] == 20 - DECISION for r in range(2)), auto
    _check_last_epoch(auto, 3, 1, new=(2,))
    assert all(auto[r][2]["impl_step"] == 30 - DECISION for r in range(3)), auto

    init = torch.tensor(lines[1]["params"])

    def start_model(rank: int) -> torch.nn.Module:
        model = torch.nn.Linear(4, 1)
        with torch.no_grad():
            model.weight.copy_(init[:4].view(1, 4))
            model.bias.copy_(init[4:])
        return model

    ref = ra.ReferenceCluster(
        "decentralized", 3, start_model,
        lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
        lambda ps: torch.optim.SGD(ps, lr=0.01 * 3),
        peer_selection_mode="shift_one", communication_interval=2,
    )  # fmt: skip
    ref.t = 20 - DECISION  # the chosen algorithm's steps before epoch 2
    for batch in range(10):
        ref.step([_sample(r, 2, batch) for r in range(3)])
    for r, want in enumerate(ref.parameters()):
        got = torch.tensor(auto[r][2]["params"])
        want = torch.cat([p.flatten() for p in want])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"rank {r}")
    # The ranks' models differ (the reference is not a plain average).
    assert auto[0][2]["params"] != auto[1][2]["params"], auto
