"""algorithm="auto" (docs/algorithms.md, "Auto") in an elastic torch job through the real
launcher: the choice is made, then the job is reset for real (a host joins), and every rank,
the new one included, keeps the choice without measuring again.

The job is tests/workers/elastic_torch_main.py (hvd.elastic.run, TorchState, a commit per
batch) with ``BAGUA_HVD_ALGORITHM=auto``: the default ``Auto()`` (GradientAllReduce and
ByteGrad, 2 warm-up steps, 5 measured steps per candidate), ByteGrad made 100 ms slower per
step by the test hook. By the documented schedule, steps 0 to 7 run GradientAllReduce, 8 to 13
ByteGrad, and the choice runs from step 14 (epoch 1, batch 4 of 10 batches per epoch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mp_runner import needs_core
from test_elastic import _explain, _replay, _run

pytest.importorskip("torch")
pytestmark = needs_core

GAR, BYTEGRAD = 0, 1  # the default candidates' indices
DECISION = 2 + 2 * (5 + 1)  # the first step of the chosen candidate (docs/algorithms.md)


def _auto_lines(tmp: Path, rank: int) -> dict[int, dict]:
    """The worker's per-epoch lines of rank ``rank`` (at the time of writing), by epoch."""
    rows = (tmp / f"log.jsonl.auto.{rank}").read_text().splitlines()
    return {row["epoch"]: row for row in map(json.loads, rows)}


ENV = {"BAGUA_HVD_ALGORITHM": "auto", "BAGUA_HVD_TEST_ALGORITHM_DELAY": "ByteGrad:0.1"}
MEASURING = [[c, False] for c in [GAR] * 8 + [BYTEGRAD] * 6]  # steps 0-13: (candidate, final)
CHOSEN = [[GAR, True]] * 16  # steps 14-29


def _check_first_epochs(out: str, auto: dict[int, dict[int, dict]], ranks: range) -> None:
    """Epochs 0 and 1 of the workers from the start (``ranks``): the measurement, then the
    choice of GradientAllReduce from step 14, printed once."""
    assert out.count("bagua_hvd auto: chose") == 1, out
    assert f"bagua_hvd auto: chose GradientAllReduce from step {DECISION}" in out, out
    for r in ranks:
        assert auto[r][0]["steps"] == MEASURING[:10], auto[r][0]
        assert auto[r][1]["steps"] == MEASURING[10:] + CHOSEN[:6], auto[r][1]
        assert (auto[r][1]["chosen"], auto[r][1]["chosen_step"]) == (GAR, DECISION)
        assert auto[r][1]["measured"] == 2 * 5, auto[r][1]


def _check_last_epoch(auto: dict[int, dict[int, dict]], size: int, new: tuple = ()) -> None:
    """Epoch 2, after the reset, on every rank (``new``: the ranks that joined): the chosen
    GradientAllReduce at every step, the choice's step from rank 0, nothing measured since
    the first epochs' 2 x 5 steps (on a new rank: nothing), the same weights."""
    for r in range(size):
        row = auto[r][2]
        assert row["size"] == size, row
        assert row["steps"] == CHOSEN[6:], row
        assert (row["chosen"], row["chosen_step"]) == (GAR, DECISION), row
        assert row["measured"] == (0 if r in new else 2 * 5), row
        assert row["params"] == auto[0][2]["params"], (r, row, auto[0][2])


def test_auto_choice_survives_a_host_joining(tmp_path: Path) -> None:
    """Two workers on localhost choose GradientAllReduce at step 14 (epoch 1); after epoch 1 a
    third host appears and the job resets to 3 ranks. In epoch 2 every rank, the new worker
    (rank 2) included, runs the chosen GradientAllReduce at every step, with the step count
    taken from rank 0, and measures nothing. The weights after epoch 2 equal an independent
    replay (SGD on the gradient averaged over the 3 ranks) from those logged after epoch 1."""
    schedule = [(0, ["localhost:2"]), (1, ["localhost:2"]), (None, ["localhost:2", "127.0.0.1:1"])]
    proc, lines = _run(tmp_path, np=2, min_np=2, max_np=3, schedule=schedule, env=ENV)
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 2, 1), (1, 2, 1), (2, 3, 2),
    ], _explain(proc)  # fmt: skip
    auto = {r: _auto_lines(tmp_path, r) for r in range(3)}
    _check_first_epochs(proc.stdout, auto, range(2))
    assert sorted(auto[2]) == [2], auto[2]  # the new worker ran epoch 2 only
    _check_last_epoch(auto, 3, new=(2,))
    assert all(auto[r][2]["step"] == 30 for r in range(3)), auto  # rank 0's count
    assert auto[0][2]["params"] == lines[2]["params"]
    _replay(lines[2:], init=lines[1]["params"], first_epoch=2)


def test_auto_choice_survives_a_worker_killed(tmp_path: Path) -> None:
    """Three workers on two hosts choose GradientAllReduce at step 14; the one on 127.0.0.1
    (start rank 2) is killed before batch 3 of epoch 2: the two others restore the commit after
    batch 2 (its optimizer state holds the choice) and go on at size 2 with the chosen
    GradientAllReduce, measuring nothing. The weights after epoch 2 equal the replay from epoch
    1's at sizes [3, 3, 3, 2, ...]: the failed step rolled back, not applied twice or lost."""
    schedule = [(None, ["localhost:2", "127.0.0.1:1"])]
    proc, lines = _run(tmp_path, np=3, min_np=2, max_np=3, schedule=schedule, env=ENV,
                       exit_schedule={(2, 3): [2]}, exit_mode="kill")  # fmt: skip
    assert proc.returncode == 0, _explain(proc)
    assert [(x["epoch"], x["size"], x["rendezvous"]) for x in lines] == [
        (0, 3, 1), (1, 3, 1), (2, 2, 2),
    ], _explain(proc)  # fmt: skip
    assert lines[2]["sizes"] == [3] * 3 + [2] * 7, lines[2]
    auto = {r: _auto_lines(tmp_path, r) for r in range(3)}
    _check_first_epochs(proc.stdout, auto, range(3))
    _check_last_epoch(auto, 2)
    assert auto[0][2]["params"] == lines[2]["params"]
    _replay(lines[2:], init=lines[1]["params"], first_epoch=2)
