"""A spy on the grouped allreduces that TensorFlow's tapes and distributed optimizers request
(``bagua_hvd.tensorflow.tape``'s ``allreduce_grads``): in a graph they add the kernel
themselves (``allreduce_kernel`` gives its attributes), otherwise they call
``grouped_allreduce``."""

from __future__ import annotations

from typing import Any, Callable


def spy_grouped_requests(
    monkeypatch: Any, hvd_tf: Any, record: Callable[[list, int, float, float], None]
) -> None:
    """Calls ``record(tensors, op, prescale_factor, postscale_factor)`` for each request; in a
    graph ``tensors`` are those on the wire (compressed), otherwise those given."""
    tape = hvd_tf.tape
    real, real_kernel = tape.grouped_allreduce, tape.allreduce_kernel

    def spy(tensors, **kw):
        record(list(tensors), kw["op"], kw["prescale_factor"], kw["postscale_factor"])
        return real(tensors, **kw)

    def kernel_spy(tensors, op, prescale_factor, postscale_factor, *args):
        kernel = real_kernel(tensors, op, prescale_factor, postscale_factor, *args)
        if kernel is not None:  # else grouped_allreduce follows
            record(list(tensors), op, prescale_factor, postscale_factor)
        return kernel

    monkeypatch.setattr(tape, "grouped_allreduce", spy)
    monkeypatch.setattr(tape, "allreduce_kernel", kernel_spy)
