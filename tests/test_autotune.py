"""Horovod's autotuner (HOROVOD_AUTOTUNE; bagua_hvd/common/autotune.py, native/src/core/autotune.h).

- The tuner's procedure on its own (no job): warm-up scores dropped, the joint tunables
  evaluated at Horovod's test points then by the Gaussian process inside their bounds, one pass
  per setting of each categorical tunable, the fixed tunables left as set, Horovod's CSV with
  the best row last, the variables validated.
- Real jobs at 2 ranks through bagua-run, rank 1's timing made different from rank 0's: every
  rank executes the same responses, fused the same way, with the same hierarchical setting, in
  the same order (BAGUA_HVD_RESPONSE_LOG), while the tuner changes the fusion threshold, cycle
  time and cache; the bucket size changes at the same step on every rank and the training equals
  plain averaged SGD computed here, independently.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from mp_runner import launch, needs_core, run_command

from bagua_hvd.common import autotune, config

pytestmark = needs_core
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "workers" / "autotune_worker.py"
HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
          "cycle_time_ms,tensor_fusion_threshold,bucket_size_mb,score")  # fmt: skip
AUTOTUNE_VARIABLES = [
    "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME",
    "HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLREDUCE", "BAGUA_HVD_FUSION_THRESHOLD",
    "BAGUA_HVD_CYCLE_TIME", "BAGUA_HVD_CACHE_CAPACITY", "BAGUA_HVD_HIERARCHICAL_ALLREDUCE",
    "BAGUA_HVD_BUCKET_MB",
]  # fmt: skip


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    for name in AUTOTUNE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOROVOD_AUTOTUNE", "1")
    return monkeypatch


def rows_of(path: Path) -> list:
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER
    return [dict(zip(HEADER.split(","), map(float, r))) for r in csv.reader(lines[1:])]


# ---- the tuner's procedure ----------------------------------------------------------------------
def synthetic_score(p: dict) -> float:
    """A smooth landscape (its best at 20 MB, 3 ms, 6 MiB buckets) plus the categorical terms."""
    return (
        100.0
        - ((p["fusion_threshold_mb"] - 20) / 8) ** 2
        - ((p["cycle_time_ms"] - 3) / 10) ** 2
        - ((p["bucket_size_mb"] - 6) / 8) ** 2
        + (5.0 if p["cache_enabled"] else 0.0)
        + (2.0 if p["hierarchical_allreduce"] else 0.0)
    )


def drive(manager: autotune.ParameterManager, limit: int = 1000) -> list:
    """Feeds the synthetic score of the values in effect until tuning ends; the values scored."""
    seen = []
    for _ in range(limit):
        p = manager.params()
        seen.append(p)
        if not manager.update(synthetic_score(p)):
            return seen
    pytest.fail("tuning did not end")


def test_procedure_counts_bounds_and_best(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    log = tmp_path / "tune.csv"
    env.setenv("HOROVOD_AUTOTUNE_LOG", str(log))
    env.setenv("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "2")
    env.setenv("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "7")
    lines: list = []
    manager = autotune.ParameterManager(config.autotune(), True, lines.append)
    manager.use_buckets(True)
    seen = drive(manager)
    # 2 warm-up scores, then 7 joint scores under each of 2 x 2 categorical settings.
    assert len(seen) == 2 + 7 * 4
    rows = rows_of(log)
    assert len(rows) == 7 * 4 + 1
    scored, best = rows[:-1], rows[-1]
    # Horovod's order: the joint tunables first (its four test points), then the odometer.
    tests = [(4, 5, 10), (32, 50, 25), (16, 25, 4), (8, 10, 1)]
    for k in range(4):
        block = scored[7 * k : 7 * k + 7]
        assert [(r["tensor_fusion_threshold"], r["cycle_time_ms"], r["bucket_size_mb"])
                for r in block[:4]] == tests  # fmt: skip
        assert {(r["hierarchical_allreduce"], r["cache_enabled"]) for r in block} == {
            [(0, 1), (1, 1), (0, 0), (1, 0)][k]
        }
        for r in block[4:]:  # the Gaussian process's proposals: inside the bounds
            assert 0 <= r["tensor_fusion_threshold"] <= 64
            assert 1 <= r["cycle_time_ms"] <= 100
            assert 1 <= r["bucket_size_mb"] <= 64
    assert all(r["hierarchical_allgather"] == 0 and r["torus_allreduce"] == 0 for r in rows)
    # Each score is the landscape's at the row's values (written with 6 digits).
    for r in scored:
        p = {"fusion_threshold_mb": r["tensor_fusion_threshold"], "cycle_time_ms":
             r["cycle_time_ms"], "bucket_size_mb": r["bucket_size_mb"], "cache_enabled":
             r["cache_enabled"], "hierarchical_allreduce": r["hierarchical_allreduce"]}  # fmt: skip
        assert synthetic_score(p) == pytest.approx(r["score"], abs=1e-2)
    # The best row is the best scored row, and the values in effect from then on.
    top = max(scored, key=lambda r: r["score"])
    assert best == top
    final = manager.params()
    assert (final["fusion_threshold_mb"], final["cache_enabled"]) == pytest.approx(
        (top["tensor_fusion_threshold"], top["cache_enabled"]), rel=1e-5
    )
    # The Gaussian process found a better point than Horovod's test points (best 98.0...).
    assert top["score"] > max(r["score"] for r in scored if r["cycle_time_ms"] in (5, 50, 25, 10))
    assert lines[0].startswith("Autotuner: Tunable params [hierarchical_allreduce,")
    assert lines[1:3] == [
        "Autotuner: Warming up (1 remaining)",
        "Autotuner: Warming up (0 remaining)",
    ]
    assert lines[-1].startswith("Autotuner: Best params [")


def test_fixed_tunables_stay_as_set(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    log = tmp_path / "tune.csv"
    env.setenv("HOROVOD_AUTOTUNE_LOG", str(log))
    env.setenv("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "0")
    env.setenv("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "6")
    env.setenv("HOROVOD_CYCLE_TIME", "2.5")
    env.setenv("HOROVOD_CACHE_CAPACITY", "0")
    env.setenv("BAGUA_HVD_BUCKET_MB", "3")
    env.setenv("HOROVOD_HIERARCHICAL_ALLREDUCE", "1")
    manager = autotune.ParameterManager(config.autotune(), True)
    manager.use_buckets(True)
    seen = drive(manager)
    assert len(seen) == 6  # only the fusion threshold is tuned: one pass
    rows = rows_of(log)
    assert {(r["cycle_time_ms"], r["cache_enabled"], r["bucket_size_mb"],
             r["hierarchical_allreduce"]) for r in rows} == {(2.5, 0, 3, 1)}  # fmt: skip
    assert [r["tensor_fusion_threshold"] for r in rows[:4]] == [4, 32, 16, 8]
    # Everything fixed: nothing to tune, the first score ends it.
    env.setenv("HOROVOD_FUSION_THRESHOLD", str(8 << 20))
    manager = autotune.ParameterManager(config.autotune(), False)
    assert len(drive(manager)) == 1
    assert manager.params()["fusion_threshold_mb"] == 8


def test_hierarchy_and_buckets_tuned_only_where_they_matter(env: pytest.MonkeyPatch) -> None:
    env.setenv("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "0")
    env.setenv("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "4")
    manager = autotune.ParameterManager(config.autotune(), False)  # one host: flat only
    seen = drive(manager)  # and no bucketed optimizer: the bucket size stays
    assert len(seen) == 4 * 2
    assert {p["hierarchical_allreduce"] for p in seen} == {False}
    assert {p["bucket_size_mb"] for p in seen} == {10.0}


@pytest.mark.parametrize("name,value,message", [
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "-1", "must be an integer >= 0, got '-1'"),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0", "must be an integer >= 1, got '0'"),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "ten", "must be an integer >= 1, got 'ten'"),
    ("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "0", "must be an integer >= 1"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "1.5", "must be a number in [0.0, 1.0]"),
])  # fmt: skip
def test_bad_variables(env: pytest.MonkeyPatch, name: str, value: str, message: str) -> None:
    env.setenv(name, value)
    with pytest.raises(
        ValueError, match=f"^{name} {message}".replace("[", r"\[").replace("(", r"\(")
    ):
        config.autotune()


def test_variables_and_defaults(env: pytest.MonkeyPatch) -> None:
    s = config.autotune()
    assert (s.log_file, s.warmup_samples, s.steps_per_sample, s.bayes_opt_max_samples,
            s.gaussian_process_noise, s.fixed) == ("", 3, 10, 20, 0.8, {})  # fmt: skip
    env.setenv("HOROVOD_AUTOTUNE_LOG", "t.csv")
    env.setenv("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "0")
    env.setenv("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "4")
    env.setenv("HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "9")
    env.setenv("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.25")
    env.setenv("BAGUA_HVD_FUSION_THRESHOLD", str(2 << 20))  # the alias counts as set
    s = config.autotune()
    assert (s.log_file, s.warmup_samples, s.steps_per_sample, s.bayes_opt_max_samples,
            s.gaussian_process_noise, s.fixed) == ("t.csv", 0, 4, 9, 0.25,
                                                   {"fusion_threshold_mb": 2.0})  # fmt: skip
    env.setenv("HOROVOD_AUTOTUNE", "0")
    assert config.autotune() is None


# ---- real jobs ----------------------------------------------------------------------------------
def run_job(tmp_path: Path, mode: str, steps: int, **env: str) -> str:
    return run_command(launch(2) + [sys.executable, str(WORKER), mode, str(steps), str(tmp_path)],
                       f"the {mode} job", timeout=300, **env)  # fmt: skip


def test_every_rank_runs_the_same_cycles(tmp_path: Path) -> None:
    log = tmp_path / "tune.csv"
    responses = tmp_path / "responses"
    responses.mkdir()
    out = run_job(tmp_path, "ops", 5000, HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_LOG=str(log),
                  HOROVOD_AUTOTUNE_WARMUP_SAMPLES="1", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="1",
                  HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="5", HOROVOD_LOG_LEVEL="info",
                  BAGUA_HVD_RESPONSE_LOG=str(responses))  # fmt: skip
    assert "Autotuner: Best params [" in out, out
    rows = rows_of(log)
    assert len(rows) == 5 * 2 + 1  # one host: the cache is the only categorical tunable
    assert len({(r["tensor_fusion_threshold"], r["cycle_time_ms"]) for r in rows}) >= 4
    assert {r["cache_enabled"] for r in rows[:-1]} == {0, 1}
    # Every rank executed the same responses, fused alike, in the same order.
    logs = [(responses / f"rank.{r}.log").read_text().splitlines() for r in (0, 1)]
    assert logs[0] == logs[1]
    assert len(logs[0]) >= 50
    fused = {line.split()[-1] for line in logs[0]}
    assert len(fused) > 2, "the tuned fusion threshold and cycle time never changed the fusion"
    assert all(line.split()[3] == "0" for line in logs[0])  # one host: flat allreduce


def test_tensorflow_jobs_are_tuned_alike(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    log, responses = tmp_path / "tune.csv", tmp_path / "responses"
    responses.mkdir()
    run_job(tmp_path, "tf-ops", 5000, HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_LOG=str(log),
            HOROVOD_AUTOTUNE_WARMUP_SAMPLES="0", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="1",
            HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="4", HOROVOD_CACHE_CAPACITY="0",
            BAGUA_HVD_RESPONSE_LOG=str(responses))  # fmt: skip
    rows = rows_of(log)
    assert len(rows) == 4 + 1 and {r["cache_enabled"] for r in rows} == {0}
    logs = [(responses / f"rank.{r}.log").read_text().splitlines() for r in (0, 1)]
    assert logs[0] == logs[1] and len(logs[0]) >= 4 * 5  # 4 scores of 5 one-step samples


def test_bucket_size_changes_at_the_same_step_and_training_stays_exact(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(WORKER.parent))
    import autotune_worker as w

    run_job(tmp_path, "optimizer", 2000, HOROVOD_AUTOTUNE="1",
            HOROVOD_AUTOTUNE_WARMUP_SAMPLES="0", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="1",
            HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES="4", HOROVOD_CACHE_CAPACITY="1024",
            HOROVOD_AUTOTUNE_LOG=str(tmp_path / "tune.csv"))  # fmt: skip
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results[0]["caps"] == results[1]["caps"]
    caps = results[0]["caps"]
    steps = results[0]["steps"]  # the job ran until tuning ended, then 5 steps
    assert results[1]["steps"] == steps
    assert len({c for c, _ in caps}) >= 3, caps  # the test points' sizes were run
    assert len({n for _, n in caps}) >= 2, caps  # and planned different buckets
    assert not results[0]["tuning"] and not results[1]["tuning"], "tuning did not end"
    best = rows_of(tmp_path / "tune.csv")[-1]["bucket_size_mb"]
    assert caps[-1][0] == int(best * (1 << 20))
    # Plain averaged SGD, computed here: the bucket layouts must not change the result.
    model = w.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(steps):
        grads = []
        for rank in (0, 1):
            model.zero_grad()
            w.loss_of(model, w.batch(rank, step)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for a, b in zip(got, model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def test_a_bad_variable_fails_init_on_every_rank(tmp_path: Path) -> None:
    code = ("import bagua_hvd.torch as hvd\n"
            "try:\n    hvd.init()\nexcept ValueError as e:\n    print('REFUSED', e)\n")  # fmt: skip
    out = run_command(launch(2) + [sys.executable, "-c", code], "the job",
                      HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="0")  # fmt: skip
    for r in (0, 1):
        assert (
            f"[{r}]<stdout>:REFUSED HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE must be an integer >= 1"
            in out
        ), out
