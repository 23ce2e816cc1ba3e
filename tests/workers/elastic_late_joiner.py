"""Runs an elastic worker's command (argv[2:]); the worker started on host argv[1] first marks
its start (argv[1] + ".started" in the working directory, for the discovery script) and waits
until the driver has published host update 2, so that the update reaches the job's other
workers while they are still waiting for this one in the new generation's rendezvous."""

from __future__ import annotations

import os
import sys

if os.environ["HOROVOD_HOSTNAME"] == sys.argv[1]:
    from bagua_hvd.rendezvous.store import StoreClient

    open(f"{sys.argv[1]}.started", "w").close()
    secret = bytes.fromhex(os.environ["BAGUA_HVD_SECRET"])
    addr = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"]
    port = int(os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"])
    with StoreClient(addr, port, secret) as client:
        client.get("elastic/update/2", timeout=120.0)
os.execv(sys.argv[2], sys.argv[2:])
