"""CUDA support on a machine without a GPU (docs/gpu.md): the package builds, imports and runs
without CUDA or NCCL; NCCL is found and loaded at run time (the real library of the
nvidia-nccl-cu13 wheel, which loads without a GPU), and every way of not having it, or not
having a GPU, is a clear error or the documented fallback, never a crash. What needs a GPU is
checked by native/tests/run_gpu_check.sh on a GPU machine."""

from __future__ import annotations

import ctypes.util
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

from mp_runner import REPO, launch, needs_core, run_command

pytestmark = needs_core

# Each case runs in its own process: NCCL is loaded once per process.
LOAD = """
import sys
from bagua_hvd.common import _native
from bagua_hvd.common.frontend import basics
lib = _native.lib()
ffi = _native.ffi
library, fallback = sys.argv[1], sys.argv[2]
code = lib.bhvd_nccl_load(library.encode() or ffi.NULL, fallback.encode() or ffi.NULL)
print("version:", code)
print("error:", _native.last_error() if code == 0 else "")
print("again:", lib.bhvd_nccl_load(ffi.NULL, ffi.NULL))
print("cuda_built:", int(basics.cuda_built()))
print("nccl_built:", basics.nccl_built())
"""


def _load(library: str, fallback: str, **env: str) -> dict:
    text = run_command([sys.executable, "-c", LOAD, library, fallback], "NCCL load", **env)
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


def _wheel() -> Path:
    spec = importlib.util.find_spec("nvidia.nccl")
    assert spec and spec.submodule_search_locations, "the nvidia-nccl-cu13 wheel ([test] extra)"
    return Path(list(spec.submodule_search_locations)[0]) / "lib" / "libnccl.so.2"


def _built_with_cuda() -> Optional[bool]:
    """Whether the library under test was built with nvcc, as its CMake tree records it (every
    setup.py/pip build of this checkout configures build/cmake-<python>): the reference for
    cuda_built(), independent of the library. None where no such tree built it
    (BAGUA_HVD_LIBRARY, an installed wheel)."""
    cache = REPO / "build" / f"cmake-{sys.implementation.cache_tag}" / "CMakeCache.txt"
    if "BAGUA_HVD_LIBRARY" in os.environ or not cache.exists():
        return None
    entries = dict(
        line.split("=", 1)
        for line in cache.read_text().splitlines()
        if "=" in line and ":" in line.split("=", 1)[0]
    )
    values = {key.split(":", 1)[0]: value for key, value in entries.items()}
    compiler = values.get("CMAKE_CUDA_COMPILER", "")
    return (
        values.get("BAGUA_HVD_WITH_CUDA") != "0"
        and bool(compiler)
        and not compiler.endswith("NOTFOUND")
    )


def _check_cuda_built(reported: str) -> None:
    expected = _built_with_cuda()
    if expected is not None:
        assert reported == str(int(expected)), f"cuda_built() {reported}, the build says {expected}"


def _wheel_version_code() -> int:
    # The independent reference: the wheel's own metadata ("2.32.3" -> NCCL_VERSION_CODE 23203).
    major, minor, patch = (
        int(x) for x in importlib.metadata.version("nvidia-nccl-cu13").split(".")[:3]
    )
    return major * 10000 + minor * 100 + patch


def test_nccl_loads_from_the_wheel_with_its_version() -> None:
    out = _load("", str(_wheel()))
    assert int(out["version"]) == _wheel_version_code(), out
    assert int(out["again"]) == _wheel_version_code(), out  # loaded once, kept
    _check_cuda_built(out["cuda_built"])
    # nccl_built(): the loaded version where the core runs CUDA tensors (a build with nvcc), 0
    # in a build without CUDA, as Horovod's nccl_built() is 0 without NCCL operations.
    assert int(out["nccl_built"]) == (_wheel_version_code() if out["cuda_built"] == "1" else 0)


def test_nccl_is_found_by_hvd_nccl_built_without_configuration() -> None:
    # basics.nccl_built() finds the wheel itself (the frontends load NCCL at hvd.init()).
    text = run_command([sys.executable, "-c", (
        "import bagua_hvd.torch as hvd; print('cuda_built:', int(hvd.cuda_built()));"
        "print('nccl_built:', hvd.nccl_built())")], "nccl_built")  # fmt: skip
    out = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    _check_cuda_built(out["cuda_built"])
    expected = _wheel_version_code() if out["cuda_built"] == "1" else 0
    assert int(out["nccl_built"]) == expected, text


def test_a_missing_nccl_library_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "libnccl.so.2"
    out = _load(str(missing), "")
    assert out["version"] == "0", out
    assert "NCCL not found" in out["error"] and f"cannot load {missing}" in out["error"], out
    assert out["again"] == "0" and out["nccl_built"] == "0", out
    # Through the environment as a user sets it: the frontend reports no NCCL, and runs.
    text = run_command([sys.executable, "-c", (
        "import torch, bagua_hvd.torch as hvd; hvd.init(); print('nccl_built:', hvd.nccl_built());"
        "print('sum:', hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist())")],
        "nccl_built with a missing library", BAGUA_HVD_NCCL_LIBRARY=str(missing))  # fmt: skip
    assert "nccl_built: 0" in text and "sum: [1.0, 1.0, 1.0]" in text, text


def test_a_library_that_is_not_nccl_is_refused_by_name() -> None:
    other = ctypes.util.find_library("z")
    assert other, "zlib"
    path = next((str(p) for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64",
                                  "/usr/lib64") if (p := Path(d) / other).exists()), other)  # fmt: skip
    out = _load(path, "")
    assert out["version"] == "0", out
    assert "is not a usable NCCL: it has no ncclGetVersion" in out["error"], out


def test_a_library_already_loaded_is_preferred(tmp_path: Path) -> None:
    # torch's CUDA builds load the wheel's libnccl first: the core uses that one, not a second
    # copy. Here the process loads it with ctypes, and the fallback given is a wrong path.
    code = (
        "import ctypes, sys; ctypes.CDLL(sys.argv[1]);"
        "from bagua_hvd.common import _native; lib = _native.lib(); ffi = _native.ffi;"
        "print('version:', lib.bhvd_nccl_load(ffi.NULL, b'/nonexistent/libnccl.so.2'))"
    )
    text = run_command([sys.executable, "-c", code, str(_wheel())], "preloaded NCCL")
    assert f"version: {_wheel_version_code()}" in text, text


WORKER = """
import numpy as np, torch
import bagua_hvd.torch as hvd
from bagua_hvd.common import ops
hvd.init()
a = np.arange(4, dtype=np.float32)
try:
    ops.enqueue(ops.OP_ALLREDUCE, [(a.ctypes.data, ops.FLOAT32, (4,))],
                [(a.ctypes.data, ops.FLOAT32, (4,))], name="on.device", device=0)
    print("device request: accepted")
except ValueError as e:
    print("device request:", type(e).__name__, e)
print("after:", hvd.allreduce(torch.arange(4.0), op=hvd.Sum, name="after").tolist())
print("cuda_built:", int(hvd.cuda_built()))
"""


def test_a_cuda_request_without_a_gpu_is_a_clear_error_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    text = run_command(
        launch(2) + [sys.executable, str(script)], "a device request on a CPU machine"
    )
    lines = [line for line in text.splitlines() if "device request:" in line]
    assert len(lines) == 2, text
    built = "cuda_built: 1" in text
    _check_cuda_built("1" if built else "0")
    for line in lines:
        # A build with nvcc on a machine without a GPU, or a build without CUDA: each says so.
        reason = "CUDA is not usable" if built else "this build of bagua_hvd has no CUDA support"
        assert "ValueError" in line and reason in line, text
    # The job stays usable: the next collective runs on both ranks.
    assert text.count("after: [0.0, 2.0, 4.0, 6.0]") == 2, text


PRIMITIVES = """
import numpy as np
import bagua_hvd.torch as hvd
from bagua_hvd.common import primitives as P
from bagua_hvd.common import ops
hvd.init()
a = np.ones(8, dtype=np.float32)
host = P.Buffer(a.ctypes.data, ops.FLOAT32, 8)
dev = P.Buffer(a.ctypes.data, ops.FLOAT32, 8, 0, 0)
def attempt(what, fn):
    try:
        fn()
        print(what + ": accepted")
    except Exception as e:
        print(what + ":", type(e).__name__, e)
attempt("bucket on device", lambda: P.allreduce(dev, "p.dev", 0, reduce_op=ops.Sum).wait())
attempt("mixed devices", lambda: P.allreduce(dev, "p.mix", 0, reduce_op=ops.Sum, compressed=True,
                                             residuals=(host, host)).wait())
attempt("async averaging on device", lambda: P.AsyncAverager("p.async", [dev], 0, 100))
P.allreduce(host, "p.host", 0, reduce_op=ops.Sum).wait()
print("host bucket after:", a[:2].tolist())
print("cuda_built:", int(hvd.cuda_built()))
"""


def test_bagua_primitives_on_cuda_buffers_say_what_they_need() -> None:
    text = run_command([sys.executable, "-c", PRIMITIVES], "primitives on device buffers")
    out = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    if out["cuda_built"] == "1":
        # The core takes them; this machine has no GPU, which the core says.
        assert (
            out["bucket on device"].startswith("ValueError") and "CUDA" in out["bucket on device"]
        ), text
        assert (
            out["mixed devices"].startswith("ValueError") and "one device" in out["mixed devices"]
        ), text
        assert out["async averaging on device"].startswith("ValueError"), text
        assert "async model averaging: CUDA is not usable" in out["async averaging on device"], text
    else:
        assert (
            out["bucket on device"].startswith("NotImplementedError")
            and "built without nvcc" in out["bucket on device"]
        ), text
        assert out["mixed devices"].startswith("NotImplementedError"), text
        assert out["async averaging on device"].startswith("NotImplementedError"), text
        assert "built without nvcc" in out["async averaging on device"], text
    assert out["host bucket after"] == "[1.0, 1.0]", text


def test_grouped_operations_refuse_tensors_of_two_devices() -> None:
    # The core takes one device per request: a group mixing devices is refused before it
    # (here a CPU and a "meta" tensor, which no machine needs a GPU for), with Horovod's error
    # (a std::logic_error in horovod/torch/mpi_ops_v2.cc, re-raised by its Python wrapper as
    # HorovodInternalError, a RuntimeError: Horovod's test_horovod_grouped_allreduce_cpu_gpu_error
    # catches RuntimeError).
    code = (
        "import torch, bagua_hvd.torch as hvd; hvd.init()\n"
        "for name, fn in [('grouped_allreduce', hvd.grouped_allreduce),\n"
        "                 ('grouped_allgather', hvd.grouped_allgather),\n"
        "                 ('grouped_reducescatter', hvd.grouped_reducescatter)]:\n"
        "    try:\n"
        "        fn([torch.ones(2), torch.ones(2, device='meta')]); print(name + ': accepted')\n"
        "    except Exception as e:\n"
        "        print(name + ': ' + type(e).__name__ + ' ' + str(e))\n"
        "print('after:', hvd.grouped_allreduce([torch.ones(2)], op=hvd.Sum)[0].tolist())\n"
    )
    text = run_command([sys.executable, "-c", code], "grouped ops on two devices")
    for name in ("grouped_allreduce", "grouped_allgather", "grouped_reducescatter"):
        assert f"{name}: HorovodInternalError Tensors in list must be on same device." in text, text
    assert "after: [1.0, 1.0]" in text, text
