"""Horovod's ``horovod.runner.common.util.env``: the launcher's variables as Horovod reads them."""

from __future__ import annotations

import os
import re
from typing import Tuple

from bagua_hvd.runner.common.util import secret

LOG_LEVEL_STR = ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]

# Variables a launcher does not pass on to the ranks (regular expressions, matched from the start).
IGNORE_REGEXES = {"BASH_FUNC_.*", "OLDPWD", ".*CUDA_VISIBLE_DEVICES", secret.HOROVOD_SECRET_KEY}


def is_exportable(name: str) -> bool:
    """Whether a launcher passes the variable ``name`` on to the ranks."""
    return not any(re.match(pattern, name) for pattern in IGNORE_REGEXES)


def get_env_rank_and_size() -> Tuple[int, int]:
    """(rank, size) of this process from its launcher's variables, before ``hvd.init()``:
    bagua-run's (and horovodrun's) ``HOROVOD_RANK``/``HOROVOD_SIZE``, else Open MPI's, else
    MPICH's (PMI); (0, 1) when there are none. RuntimeError when only one of a pair is set."""
    for rank_var, size_var in (
        ("HOROVOD_RANK", "HOROVOD_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
    ):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(
                f"Could not determine process rank and size: only one of {rank_var} and "
                f"{size_var} found in environment"
            )
    return 0, 1
