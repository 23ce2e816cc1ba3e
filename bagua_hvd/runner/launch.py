"""Horovod's ``horovod.runner.launch``: ``bagua-run``'s entry point (``python -m
bagua_hvd.runner.launch``) and the names programmatic launchers import from there. The launcher
itself is bagua_run.py, which imports neither this module nor programmatic.py, so that these can
import it."""

from bagua_hvd.runner.bagua_run import main, parse_args, run_commandline
from bagua_hvd.runner.flags import make_parser, no_effect_warning, tuning_env
from bagua_hvd.runner.programmatic import _HorovodArgs, _run, gloo_run, mpi_run

__all__ = [
    "_HorovodArgs",
    "_run",
    "gloo_run",
    "main",
    "make_parser",
    "mpi_run",
    "no_effect_warning",
    "parse_args",
    "run_commandline",
    "tuning_env",
]

if __name__ == "__main__":
    run_commandline()
