"""Runs the multi-process tests of BAGUA's algorithms in the TensorFlow frontend
(tests/mp/test_tf_algorithms.py) through the launcher at 2 ranks (the interface, tapes, Keras,
validation: the cases marked up_to_two_ranks) and at 3 (odd sizes matter for shift_one and the
ring), and asserts that every rank passed. Size 1 (no communication: every algorithm is the
local optimizer) is left out to save the TensorFlow start-up."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from mp_runner import _execute, launch, needs_core, run_inner

pytest.importorskip("tensorflow")
pytest.importorskip("torch")  # the reference (tests/reference_algorithms.py) is torch
pytestmark = needs_core


@pytest.mark.parametrize("np", [2, 3])
def test_tf_algorithms_multiprocess(np: int) -> None:
    text = run_inner("test_tf_algorithms.py", np)
    assert not re.search(r"\d+ skipped", text), text


# A 2-rank job whose kernel library cannot be loaded. Horovod's collectives in tf.function still
# run (the numpy_function path); every entry to BAGUA's algorithms raises ImportError on every
# rank, one JSON line each: the import, a tape and a Keras optimizer with algorithm=, and both
# without it under BAGUA_HVD_ALGORITHM (the job runs with bagua-run --algorithm bytegrad);
# algorithm=GradientAllReduce() (Horovod's allreduce) works, a tape and Keras. Then,
# after a barrier, the Keras optimizer again, uncaught, as a training script would meet it: the
# ranks exit and the job ends with a failure (not a hang).
WITHOUT_KERNELS = r"""
import json, os
if os.environ.get("CXX_BY_RANK"):  # one compiler per rank
    os.environ["CXX"] = os.environ["CXX_BY_RANK"].split(",")[int(os.environ["HOROVOD_RANK"])]
import tensorflow as tf
import bagua_hvd.tensorflow as hvd
import bagua_hvd.tensorflow.keras as hvd_keras
from bagua_hvd.common import algorithms as declarations

hvd.init()
r = hvd.rank()
total = tf.function(lambda x: hvd.allreduce(x, op=hvd.Sum))(tf.fill([3], float(r + 1)))
print(json.dumps({"rank": r, "allreduce": total.numpy().tolist()}), flush=True)
sgd = lambda: tf.keras.optimizers.SGD(0.1)
entries = {
    "import": lambda: __import__("bagua_hvd.tensorflow.algorithms"),
    "tape": lambda: hvd.DistributedGradientTape(
        tf.GradientTape(), algorithm=declarations.ByteGrad()),
    "keras": lambda: hvd_keras.DistributedOptimizer(
        sgd(), algorithm=declarations.Decentralized()),
    "environment tape": lambda: hvd.DistributedGradientTape(tf.GradientTape()),
    "environment keras": lambda: hvd_keras.DistributedOptimizer(sgd()),
}
for what, entry in entries.items():
    try:
        entry()
        error = None
    except Exception as e:
        error = {"type": type(e).__name__, "text": str(e)}
    print(json.dumps({"rank": r, "what": what, "error": error}), flush=True)
# Horovod's allreduce as an algorithm needs no kernels: the tape's gradient in a graph.
v = tf.Variable([1.0, 2.0])
try:
    tape_of = lambda t: hvd.DistributedGradientTape(t, algorithm=declarations.GradientAllReduce())
    hvd_keras.DistributedOptimizer(sgd(), algorithm=declarations.GradientAllReduce())

    @tf.function
    def step():
        with tf.GradientTape() as t:
            loss = tf.reduce_sum(v * float(r + 1))
        return tape_of(t).gradient(loss, [v])[0]

    result = step().numpy().tolist()
except Exception as e:
    result = f"{type(e).__name__}: {e}"
print(json.dumps({"rank": r, "gradient_allreduce": result}), flush=True)
hvd.allreduce(tf.ones(1), name="printed")  # every rank has printed its lines
hvd_keras.DistributedOptimizer(sgd())
"""
_ENTRIES = ["import", "tape", "keras", "environment tape", "environment keras"]
_HEAD = (
    "BAGUA's algorithms in TensorFlow (bagua_hvd.tensorflow.algorithms) needs bagua_hvd's "
    "TensorFlow kernel library, which is not available: "
)
_TAIL = " Horovod's collectives and DistributedOptimizer without algorithm= do not need it."


def _without_kernels(what: str, **env: str) -> dict:
    """Runs WITHOUT_KERNELS at 2 ranks; checks that the job ended, failed with every rank's
    uncaught ImportError or the launcher's stop, and that Horovod's allreduce ran on every
    rank. Returns {(rank, entry): its error (type, text)}, every rank's every entry."""
    cmd = launch(2) + ["--algorithm", "bytegrad", sys.executable, "-c", WITHOUT_KERNELS]
    rc, text = _execute(cmd, 300, **env)
    if rc is None:
        pytest.fail(f"{what}: the job did not end within 300 s:\n{text}")
    assert rc != 0, f"{what}: the job ended without the uncaught ImportError:\n{text}"
    assert re.search(r"^(\[\d+\]<stderr>:)?ImportError: " + re.escape(_HEAD), text, re.M), text
    lines = [json.loads(m) for m in re.findall(r"^(?:\[\d+\]<stdout>:)?(\{.*\})$", text, re.M)]
    assert sorted(x["rank"] for x in lines if "allreduce" in x) == [0, 1], text
    assert all(x["allreduce"] == [3.0] * 3 for x in lines if "allreduce" in x), text
    ga = [x["gradient_allreduce"] for x in lines if "gradient_allreduce" in x]
    assert ga == [[1.5, 1.5]] * 2, text  # the mean of 1 and 2, through Horovod's path
    errors = {(x["rank"], x["what"]): x["error"] for x in lines if "what" in x}
    assert sorted(errors) == [(r, w) for r in (0, 1) for w in sorted(_ENTRIES)], text
    for key, error in errors.items():
        assert error is not None and error["type"] == "ImportError", (key, error)
        assert error["text"].startswith(_HEAD) and error["text"].endswith(_TAIL), (key, error)
    return errors


def test_algorithms_without_the_kernel_library(tmp_path: Path) -> None:
    """The library cannot be built (a fresh cache): on rank 0 the compiler does not exist, on
    rank 1 it fails. Each error names its cause and what to install."""
    errors = _without_kernels(
        "no compiler / a failing compiler",
        BAGUA_HVD_CACHE_DIR=str(tmp_path),
        CXX_BY_RANK="no-such-g++,/bin/false",
    )
    for (rank, _), error in errors.items():
        why, *output, fix = error["text"][len(_HEAD) :].split("\n")
        if rank == 0:
            assert why == (
                "the C++ compiler 'no-such-g++' ($CXX, default g++) was not found or is not "
                "executable"
            ), error
            assert not output, error
            assert fix.startswith("Install a C++17 compiler (g++ 7 or newer, e.g. `apt install "
                                  "g++`, or clang) or set CXX to one, then run `python -m "
                                  "bagua_hvd.tensorflow.build_kernels`"), error  # fmt: skip
        else:
            assert why.startswith("/bin/false -std=c++17 "), error
            assert why.endswith(" failed (exit status 1)"), error
            assert "`apt install g++`" in fix and "build_kernels" in fix, error
            assert "BAGUA_HVD_TF_KERNELS" not in error["text"], error


def test_algorithms_with_the_kernels_switched_off() -> None:
    """BAGUA_HVD_TF_KERNELS=0: nothing is built; the error names the switch and how to turn
    the library back on (nothing to install)."""
    errors = _without_kernels("BAGUA_HVD_TF_KERNELS=0", BAGUA_HVD_TF_KERNELS="0")
    for error in errors.values():
        assert error["text"] == (
            f"{_HEAD}BAGUA_HVD_TF_KERNELS=0 switches it off\n"
            f"Unset BAGUA_HVD_TF_KERNELS (or set it to 1) to build and use it.{_TAIL}"
        ), error


def test_build_names_missing_tensorflow_headers(tmp_path: Path, monkeypatch) -> None:
    """A TensorFlow without its C++ headers: the build stops before the compiler with that
    cause and what to install (in this process: nothing is loaded or compiled)."""
    import tensorflow as tf

    from bagua_hvd.tensorflow import kernels

    monkeypatch.setenv("CXX", "true")  # a compiler that exists
    monkeypatch.setattr(tf.sysconfig, "get_include", lambda: str(tmp_path))
    with pytest.raises(kernels.BuildError) as caught:
        kernels._build(tmp_path / "library.so")
    assert str(caught.value) == (
        f"TensorFlow's C++ headers are missing (no tensorflow/core/framework/op.h under "
        f"{tmp_path}, tf.sysconfig.get_include())"
    )
    assert "`pip install tensorflow`" in caught.value.remedy
    assert list(tmp_path.iterdir()) == []
