"""Horovod's ``horovod.runner.common.util``: the helpers user scripts and programmatic launchers
import from it: ``env`` (a process's rank and size from the launcher's variables), ``secret``
(job keys and their HMAC digests), ``hosts`` (host lists and Horovod's slot assignment),
``codec`` (cloudpickle in base64) and ``settings`` (the ``Settings`` that ``gloo_run`` and
``mpi_run`` take)."""
