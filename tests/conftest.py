"""Shared pytest configuration.

tests/mp/ holds tests that run inside the launcher (one pytest process per rank); the outer
tests (tests/test_torch_ops.py) start them, so the outer pytest must not collect them itself.
"""

import os
import shutil
import tempfile

import pytest

collect_ignore = ["mp"]

_SM_ENV = "OMPI_MCA_btl_sm_backing_directory"
_sm_dir = None


def pytest_configure(config):
    # An Open MPI 5 singleton (a process that imports mpi4py's MPI outside mpirun, as the tests of
    # launcher variables without their launcher do) leaves its shared-memory segment behind in
    # /dev/shm. The tests' processes put theirs in a directory removed at the end instead.
    global _sm_dir
    if _SM_ENV not in os.environ:
        _sm_dir = tempfile.mkdtemp(prefix="bagua_hvd-test-ompi-sm-")
        os.environ[_SM_ENV] = _sm_dir


def pytest_unconfigure(config):
    if _sm_dir is not None:
        os.environ.pop(_SM_ENV, None)
        shutil.rmtree(_sm_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory):
    """A local Spark standalone cluster (a master and two workers of 2 cores, bound to
    127.0.0.1) and a SparkSession on it, for the module (tests/spark_cluster.py)."""
    import spark_cluster as helper

    yield from helper.run_cluster(tmp_path_factory)
