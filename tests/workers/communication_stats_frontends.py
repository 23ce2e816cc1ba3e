"""Worker for tests/test_communication_stats.py: every frontend (torch, tensorflow,
tensorflow.keras, keras) exports the one communication_stats(), which raises ValueError before
init() and afterwards returns the table with its keys; an allreduce of each framework counts
under "allreduce". Prints "frontends OK"."""

import tensorflow as tf
import torch

import bagua_hvd.keras as hvd_k
import bagua_hvd.tensorflow as hvd_tf
import bagua_hvd.tensorflow.keras as hvd_tfk
import bagua_hvd.torch as hvd

frontends = {"torch": hvd, "tensorflow": hvd_tf, "tensorflow.keras": hvd_tfk, "keras": hvd_k}
for name, m in frontends.items():
    assert "communication_stats" in dir(m), name
    assert (
        m.communication_stats.__doc__
        and "between_hosts_bytes_sent" in m.communication_stats.__doc__
    )
    try:
        m.communication_stats()
    except ValueError as e:
        assert "has not been initialized" in str(e), e
    else:
        raise AssertionError(f"{name}: communication_stats() before init() did not raise")

hvd.init()
assert hvd.communication_stats() == {}, hvd.communication_stats()
hvd.allreduce(torch.ones(8), name="f.torch")
hvd_tf.allreduce(tf.ones(8), name="f.tf")
keys = {"within_host_bytes_sent", "between_hosts_bytes_sent", "calls"}
for name, m in frontends.items():
    stats = m.communication_stats()
    assert set(stats) == {"allreduce"}, (name, stats)
    assert set(stats["allreduce"]) == keys, (name, stats)
    # One rank: two allreduces executed, nothing to send.
    assert stats["allreduce"] == {"within_host_bytes_sent": 0, "between_hosts_bytes_sent": 0,
                                  "calls": 2}, (name, stats)  # fmt: skip
hvd.shutdown()
print("frontends OK", flush=True)
