"""Horovod's ``horovod.runner.common.util.settings``: what ``gloo_run`` and ``mpi_run`` take."""

from __future__ import annotations

from typing import Any, Iterable, Optional


class BaseSettings:
    """Horovod's launch settings (its parameters and defaults).

    Args:
        num_proc: number of ranks (-np).
        verbose: verbosity level (default 0).
        ssh_port: ssh port of the hosts.
        ssh_identity_file: ssh private key for the hosts.
        extra_mpi_args: extra arguments for mpirun, one string.
        tcp_flag: TCP only (NCCL_IB_DISABLE=1).
        binding_args: process binding arguments for mpirun / jsrun.
        key: accepted; bagua_hvd's launcher makes the job's key itself.
        start_timeout: seconds, or a Timeout-like object with a ``timeout`` attribute.
        output_filename: a directory for the ranks' output.
        run_func_mode: whether a function is run (bagua_hvd.run).
        nics: network interfaces for TCP traffic.
        elastic: accepted (elastic jobs run through bagua_hvd.run / bagua-run).
        prefix_output_with_timestamp: time stamps on the ranks' output lines.
    """

    def __init__(
        self,
        num_proc: Optional[int] = None,
        verbose: int = 0,
        ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None,
        extra_mpi_args: Optional[str] = None,
        tcp_flag: Optional[bool] = None,
        binding_args: Optional[str] = None,
        key: Any = None,
        start_timeout: Any = None,
        output_filename: Optional[str] = None,
        run_func_mode: Optional[bool] = None,
        nics: Optional[Iterable[str]] = None,
        elastic: bool = False,
        prefix_output_with_timestamp: bool = False,
    ) -> None:
        self.num_proc = num_proc
        self.verbose = verbose
        self.ssh_port = ssh_port
        self.ssh_identity_file = ssh_identity_file
        self.extra_mpi_args = extra_mpi_args
        self.tcp_flag = tcp_flag
        self.binding_args = binding_args
        self.key = key
        self.start_timeout = start_timeout
        self.output_filename = output_filename
        self.run_func_mode = run_func_mode
        self.nics = nics
        self.elastic = elastic
        self.prefix_output_with_timestamp = prefix_output_with_timestamp


class Settings(BaseSettings):
    """:class:`BaseSettings` and ``hosts``, ``"host1:slots,host2:slots"``."""

    def __init__(self, hosts: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hosts = hosts
