"""BAGUA's algorithms in the TensorFlow frontend through the kernel library (bucket_kernels.cc,
weight_kernels.cc): no Python and no numpy on a training step's data path (docs/tensorflow.md,
"How tensors reach the core").

The engine (``bagua_hvd.common.engine``) still decides everything, at trace time (eagerly: at
each call), on descriptors of the tensors: the buckets (:func:`engine.bucket_layout`), their
names on the wire, the primitive of each stage of the gradient path
(:meth:`engine.GradientPath.stages`) and error feedback's residual sizes, and when the weight algorithms act (``communicating(step)``, ``round(step)``,
``averages(step)``: written once, they give graph conditions when the step is a tensor). The
graph then holds, per step:

- ``BaguaHvdCounter``: the step counts (kept by the kernel library under the
  implementation's key: no ``tf.Variable``, so an implementation can first appear in any
  trace);
- ``BaguaHvdBuckets``: the gradient path's allreduce of one bucket (packed and unpacked in
  C++; buffers and residuals kept by the library), one asynchronous kernel per bucket, each
  started as soon as its gradients exist; or Decentralized's peer average of every weight
  bucket;
- ``BaguaHvdLpInit`` / ``BaguaHvdLpStep``: the low-precision ring, the core's (c_api.h
  ``bhvd_lp_ring_*``: it decides the split and keeps the exchange left in flight) over the
  variables' buffers, its replicas kept by the library;
- ``BaguaHvdAsyncStep``: asynchronous model averaging's step boundary;

chosen per step by ``tf.switch_case`` / ``tf.cond`` on the counts, and ``assign`` ops that
write averaged weights back into the variables.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import tensorflow as tf

import bagua_hvd.tensorflow.kernels as _kernels
import bagua_hvd.tensorflow.mpi_ops as _mpi
from bagua_hvd.common import basics as _basics
from bagua_hvd.common import config, engine
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.primitives import Buffer
from bagua_hvd.tensorflow.algorithm_impl import AlgorithmImpl, _read

__all__ = ["KernelImpl"]


class Spec(NamedTuple):
    """A buffer as the engine sees it at trace time: its size and dtype, no memory."""

    numel: int
    dtype: int  #: the core's dtype code


class Specs(engine.TensorAdapter):
    """The engine's tensors at trace time: :class:`Spec` descriptors (sizes, dtypes)."""

    errors = _mpi.TF_ERRORS

    def buffer(self, t: Spec) -> Buffer:
        return Buffer(0, t.dtype, t.numel)

    def numel(self, t: Spec) -> int:
        return t.numel

    def empty_like(self, t: Spec) -> Spec:
        return t

    def zeros_like(self, t: Spec, numel: int) -> Spec:
        return Spec(numel, t.dtype)

    def empty_bytes(self, nbytes: int, like: Any = None) -> Spec:
        return Spec(nbytes, _ops.UINT8)

    def copy_(self, dst: Spec, src: Spec) -> None:
        raise NotImplementedError("descriptors hold no data")


SPECS = Specs()


def _code(dtype: tf.DType) -> int:
    code = _mpi._TF_CODES.get(tf.as_dtype(dtype))
    if code is None:
        raise tf.errors.InvalidArgumentError(
            None, None, f"Tensor type {tf.as_dtype(dtype).name} is not supported."
        )
    return code


def _numel(t: Any, like: Any) -> int:
    """Elements of ``t``, from its static shape (else ``like``'s: the variable's)."""
    shape = tf.TensorShape(t.shape)
    shape = shape if shape.is_fully_defined() else tf.TensorShape(like.shape)
    if not shape.is_fully_defined():
        raise ValueError(
            f"BAGUA's algorithms need tensors of known shapes inside tf.function, got {shape}"
        )
    return int(shape.num_elements())


class Buckets(NamedTuple):
    """A bucket layout as the kernels take it: the tensors in bucket order, and how many each
    bucket holds."""

    layout: List[List[int]]  #: engine.bucket_layout's buckets (indices into the tensors)
    order: List[int]  #: the indices, bucket after bucket
    sizes: List[int]  #: tensors per bucket
    specs: List[Spec]  #: each bucket's flat buffer

    @staticmethod
    def of(tensors: Sequence[Any], likes: Sequence[Any]) -> Buckets:
        """The layout of ``tensors`` (or variables), sized by their static shapes (else by
        those of ``likes``, their variables)."""
        numels = [_numel(t, v) for t, v in zip(tensors, likes)]
        dtypes = [tf.as_dtype(t.dtype) for t in tensors]
        infos = [(n, dt, dt.size) for n, dt in zip(numels, dtypes)]
        layout = engine.bucket_layout(infos, config.bucket_bytes())
        return Buckets(
            layout,
            [i for b in layout for i in b],
            [len(b) for b in layout],
            [Spec(sum(numels[i] for i in b), _code(dtypes[b[0]])) for b in layout],
        )

    def inputs(self, tensors: Sequence[Any]) -> List[Any]:
        return [tensors[i] for i in self.order]

    def scatter(self, outs: Sequence[Any], into: List[Any]) -> List[Any]:
        for i, o in zip(self.order, outs):
            into[i] = o
        return into


def _branches(index: Any, fns: List[Callable[[], Any]]) -> Any:
    """``fns[index]()``: eagerly (``index`` an int), else as a graph's switch."""
    if isinstance(index, int):
        return fns[index]()
    if len(fns) == 1:
        return fns[0]()
    return tf.switch_case(index, fns)


def _when(flag: Any, fn: Callable[[], None]) -> None:
    """Runs ``fn`` when ``flag``: eagerly (a Python or numpy bool), else under ``tf.cond``."""
    if isinstance(flag, (bool, int)) or tf.executing_eagerly():
        if bool(flag):
            fn()
        return

    def then() -> tf.Tensor:
        fn()
        return tf.constant(True)

    tf.cond(flag, then, lambda: tf.constant(False))


def _handle(v: Any) -> Any:
    """The resource handle of a tf.Variable or a Keras 3 variable (its ``value``)."""
    handle = getattr(v, "handle", None)
    return handle if handle is not None else v.value.handle


def _assign(variables: Sequence[Any], values: Sequence[Any]) -> None:
    for v, x in zip(variables, values):
        v.assign(x)


class KernelImpl(AlgorithmImpl):
    """The engine's parts as the kernel library's ops (module docstring)."""

    def __init__(self, alg: Any, optimizer: Any, process_set: Any) -> None:
        super().__init__(alg, optimizer, process_set)
        self._ops = _kernels.load()
        self._key = f"bagua_tf{self.uid}"  # the library's state of this implementation
        self._bound: Optional[Tuple[Any, List[List[int]]]] = None  # weights: (sig, layout)
        self._weight_specs: List[Spec] = []
        # The weight averaging's parts, by the declaration's kind: before the update (given
        # the step and the variables), after it.
        kind = alg.weight_averaging
        before = {"peer_average": self._peer_average, "low_precision_ring": self._lp_init}
        after = {"low_precision_ring": self._lp_step, "async": self._async_step}
        self._before_update = before.get(kind)
        self._after_update = after.get(kind)
        if kind == "low_precision_ring":
            # The core's rings are one registry: the engine's shutdown hook settles these too.
            _basics.before_shutdown(engine.settle_rings_before_shutdown)
        if kind == "async":
            alg.register_impl(self)  # abort() and resume() reach the library's averager

    def adapter(self) -> engine.TensorAdapter:
        return SPECS

    # -- counts ------------------------------------------------------------------------------------
    def _counter(
        self, counter: str = "steps", mode: int = 0, value: Any = 0, agree: bool = False
    ) -> Any:
        """The library's count (before the change): an int eagerly, else an int64 tensor.
        ``agree``: in an elastic job, first (once per job) the ranks agree on the counts (a
        worker that just joined starts from 0; an allreduce, so only at the step's first read,
        which every rank makes)."""
        out = self._ops.bagua_hvd_counter(
            tf.constant(value, tf.int64) if isinstance(value, int) else value,
            key=self._key,
            counter=counter,
            mode=mode,
            message=self._after_apply_missing() if mode == 3 else "",
            agree_name=self._names.op("steps", 0) if agree and config.elastic() else "",
            process_set_id=_ops.process_set_id(self.process_set),
        )
        return int(out) if tf.executing_eagerly() else out

    def _eager_counter(self, counter: str) -> int:
        with tf.init_scope():
            return self._counter(counter)

    @property
    def step(self) -> int:
        return self._eager_counter("steps")

    def _tick(self) -> None:
        self._counter("steps", 1, 1)

    # -- the step ----------------------------------------------------------------------------------
    def _communicate(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        step = self._counter(agree=True)
        if self.needs_after_apply:
            if tf.executing_eagerly():
                if self._counter("applied") < step:
                    raise ValueError(self._after_apply_missing())
            else:
                self._counter(mode=3)
        if self.alg.uses_gradient_path:
            grads = self._gradient_path(grads, variables, step)
        if self._before_update is not None:
            self._before_update(step, variables)
        return grads

    def _after_apply(self, variables: List[Any]) -> None:
        steps = self._counter()
        self._counter("applied", 2, steps)
        self._after_update(steps - 1, variables)  # reduce_gradients counted this step

    # -- gradients ---------------------------------------------------------------------------------
    def _gradient_path(self, grads: List[Any], variables: List[Any], step: Any) -> List[Any]:
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        ins = [tf.convert_to_tensor(grads[i]) for i in present]
        pvars = [variables[i] for i in present]
        path = self.gradients
        stages = path.stages()
        staged = self.alg.staged_by_optimizer  # QAdam: the optimizer's count, its momentum
        q = self.optimizer if self.optimizer is not None else self.alg.own_optimizer()
        if staged:
            self._build_staging(q, variables)
            at = _read(q.iterations)
            at = int(at) if tf.executing_eagerly() else tf.cast(at, tf.int64)
        else:
            at = step
        if isinstance(at, int):
            index = sum(at >= first for first, _ in stages[1:])
        else:
            index = tf.add_n([tf.constant(0)] + [tf.cast(at >= first, tf.int32)
                                                 for first, _ in stages[1:]])  # fmt: skip

        # The buckets are the same in every stage (momenta are shaped as the gradients). Each
        # bucket picks its stage on its own, so that inside tf.function its op starts as soon
        # as its gradients exist (the first bucket holds the last layers', which backward
        # computes first), overlapping the rest of backward; the graph's order of stateful ops
        # submits the buckets one after the other, in the same order on every rank.
        b = Buckets.of(ins, pvars)

        def bucket_in(plan: engine.StepPlan, i: int) -> Callable[[], List[Any]]:
            def run() -> List[Any]:
                ts = [ins[j] for j in b.layout[i]]
                if not plan.communicates:
                    return [tf.identity(t) for t in ts]
                kind = "grad"
                if plan.momentum:
                    for t in ts:
                        if t.dtype != tf.float32:
                            raise ValueError(
                                f"QAdamOptimizer runs on float32 variables, not {t.dtype.name}"
                            )
                    ts = [q.momentum(pvars[j], ins[j]) for j in b.layout[i]]
                    kind = "momentum"
                return self._bucket_allreduce(ts, i, plan, kind)

            return run

        outs: List[Any] = [None] * len(ins)
        for i, bucket in enumerate(b.layout):
            for j, o in zip(bucket, _branches(index, [bucket_in(p, i) for _, p in stages])):
                outs[j] = o
        if staged:  # QAdam: whether the gradients handed over are the averaged momentum
            flags = [int(p.momentum) for _, p in stages]
            flag = flags[index] if isinstance(index, int) else tf.gather(flags, index)
            outs = [tf.constant(flag, tf.int32) if isinstance(flag, int) else flag] + outs
        return self._handed_over(grads, present, outs, q if staged else None)

    def _bucket_allreduce(
        self, tensors: List[Any], i: int, plan: engine.StepPlan, kind: str
    ) -> List[Any]:
        """The engine's allreduce of bucket ``i`` (``tensors``) as ``plan`` says: tensors of
        the same shapes."""
        # Error feedback's residuals are sized by the kernel for the job it runs in.
        return self._ops.bagua_hvd_buckets(
            tensors,
            tf.constant(0, tf.int64),
            primitive=0,
            bucket_sizes=[len(tensors)],
            names=[self._names.op(kind, i)],
            process_set_id=_ops.process_set_id(self.process_set),
            reduce_op=self.alg.reduce_op(_ops.Average),
            compressed=bool(plan.compressed),
            hierarchical=bool(self.alg.hierarchical),
            error_feedback=bool(plan.residuals),
        )

    # -- weights -----------------------------------------------------------------------------------
    def _bind(self, variables: List[Any]) -> Buckets:
        """The weight buckets (one layout per implementation: its state is per model)."""
        b = Buckets.of(variables, variables)
        sig = tuple((tuple(v.shape), tf.as_dtype(v.dtype).name) for v in variables)
        if self._bound is None:
            self._bound = (sig, b.layout)
            self._weight_specs = b.specs
        elif self._bound[0] != sig:
            raise ValueError(self._other_model_error())
        return b

    def _weights(self, variables: List[Any]) -> Tuple[Buckets, List[Any]]:
        """The weight buckets and the variables' values in bucket order."""
        b = self._bind(variables)
        return b, b.inputs([_read(v) for v in variables])

    def _handles(self, variables: List[Any]) -> Tuple[Buckets, List[Any]]:
        """The weight buckets and the variables' resource handles in bucket order (the
        kernels read and write the variables in place)."""
        b = self._bind(variables)
        return b, b.inputs([_handle(v) for v in variables])

    def _peer_average(self, step: Any, variables: List[Any]) -> None:
        avg = self.averaging

        def run() -> None:
            b, values = self._weights(variables)
            outs = self._ops.bagua_hvd_buckets(
                values,
                tf.cast(avg.round(step), tf.int64),
                primitive=1,
                bucket_sizes=b.sizes,
                names=[self._names.op("peer", i) for i in range(len(b.sizes))],
                process_set_id=avg.process_set_id,
                peer_mode=_ops.PEER_MODES[self.alg.peer_selection_mode],
                hierarchical=bool(self.alg.hierarchical),
            )
            _assign(b.inputs(variables), outs)

        _when(avg.communicating(step), run)

    def _lp_init(self, step: Any, variables: List[Any]) -> None:
        """Before the first update: the replicas (the kernel does nothing once they exist)."""
        b, handles = self._handles(variables)
        n = len(b.sizes)
        self._ops.bagua_hvd_lp_init(
            handles,
            key=self._key,
            bucket_sizes=b.sizes,
            names=[self._names.op("lp.init", i) for i in range(n)],
            step_names=[self._names.op("lp.step", i) for i in range(n)],
            exchange_names=[self._names.op("lp.x", i) for i in range(n)],
            process_set_id=self.averaging.process_set_id,
            hierarchical=bool(self.alg.hierarchical),
        )

    def _lp_step(self, step: Any, variables: List[Any]) -> None:
        ring = self.averaging

        def run() -> None:
            # The core's ring splits the step or not for the job it was started in (an elastic
            # reset, which may change the hosts after this trace, starts a new one).
            b, handles = self._handles(variables)
            self._ops.bagua_hvd_lp_step(handles, key=self._key, bucket_sizes=b.sizes)

        _when(ring.communicating(step), run)

    def _async_step(self, step: Any, variables: List[Any]) -> None:
        avg = self.averaging

        def run() -> None:
            b, handles = self._handles(variables)
            self._ops.bagua_hvd_async_step(
                handles,
                key=self._key,
                name_prefix=self._names.averager_prefix(),
                bucket_sizes=b.sizes,
                process_set_id=avg.process_set_id,
                interval_ms=int(self.alg.sync_interval_ms),
            )

        _when(avg.averages(step), run)

    # -- the engine's interface (eager) ------------------------------------------------------------
    @property
    def replicas(self) -> Optional[List[List[Any]]]:
        """Low-precision decentralized: per bucket (self, left, right), numpy copies; None
        before the replicas exist."""
        if self._bound is None:
            return None
        dtypes = {c: d for d, c in _mpi._TF_CODES.items()}
        out = []
        with tf.init_scope():
            try:
                for i, spec in enumerate(self._weight_specs):
                    reps = self._ops.bagua_hvd_lp_replicas(
                        key=self._key, bucket=i, T=dtypes[spec.dtype]
                    )
                    out.append([r.numpy() for r in reps])
            except tf.errors.InvalidArgumentError:
                return None
        return out

    def flush(self) -> None:
        with tf.init_scope():
            self._ops.bagua_hvd_lp_flush(key=self._key)

    def _async(self, mode: int) -> int:
        with tf.init_scope():
            return int(self._ops.bagua_hvd_async_control(key=self._key, mode=mode))

    def abort(self) -> None:
        self._async(0)

    def resume(self) -> None:
        self._async(1)

    def rounds(self) -> int:
        return self._async(2)

    @property
    def id(self) -> Optional[int]:
        return self._async(3) or None
