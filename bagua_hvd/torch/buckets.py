"""The gradient buckets of ``hvd.DistributedOptimizer`` and their reductions.

* **Buckets.** Gradients are fused into buckets of at most ``BAGUA_HVD_BUCKET_MB`` MiB (default
  10, BAGUA's default bucket size; fractions allowed; a bigger parameter gets a bucket of
  its own), one dtype and device per bucket, filled in the order gradients become ready:
  reverse registration order as the first guess, then the order observed during the first
  step (rank 0's, so that every rank builds the same buckets); again after an elastic reset.
  One allreduce per bucket starts as soon as its last gradient is ready, while backward still
  runs. ``BAGUA_HVD_BUCKET_MB=0`` sends one allreduce per parameter (Horovod's way, fused by
  the core within ``HOROVOD_CYCLE_TIME``). ``groups`` (Horovod's option) defines the buckets
  explicitly and overrides the size.
* **No copies in the core, no extra memory.** Each bucket owns one flat buffer and the
  parameters' ``.grad`` are views of it (like DDP's ``gradient_as_bucket_view=True``): the core
  reduces the buffer in place. Gradients accumulate straight into it when ``.grad`` is kept
  between steps (``zero_grad(set_to_none=False)``, ``backward_passes_per_step > 1``); after
  ``zero_grad()`` (``set_to_none=True``) autograd's new gradient is copied into its slot once,
  in the hook, and freed. Memory: one gradient-sized buffer, where DDP holds the gradients plus
  its bucket buffers. The core never copies a tensor of ``BAGUA_HVD_NO_FUSE_BYTES`` (1 MiB) or
  more into its fusion buffer, so full-size buckets are reduced in place; small buckets are
  fused, which is what fusion is for. ``Compression.fp16``/``bf16`` use one persistent
  low-precision buffer per bucket. Other ``Compressor`` classes compress each gradient
  separately (Horovod's semantics) and the bucket is sent as one grouped allreduce.
* A ``.grad`` tensor is reused from step to step (it is a view of the bucket): code that keeps a
  reference to last step's ``p.grad`` sees it overwritten by the next backward, as with DDP's
  ``gradient_as_bucket_view``. Code that assigns ``p.grad`` is fine (the hook copies it in).
* Sparse gradients go on their own through ``sparse_allreduce_async`` (allgathers), unless
  ``sparse_as_dense``: then they are reduced densely in their bucket and made sparse again.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import torch

import bagua_hvd.torch.mpi_ops as mpi_ops
from bagua_hvd.common import engine
from bagua_hvd.common import ops as _ops
from bagua_hvd.common.process_sets import ProcessSet
from bagua_hvd.common.util import split_list
from bagua_hvd.torch.compression import BF16Compressor, FP16Compressor, NoneCompressor
from bagua_hvd.torch.hooks import NOT_STARTED, TOO_MANY_PASSES_MESSAGE, Pending

# Compressors that are element-wise casts: a whole bucket can be compressed at once.
_CAST_COMPRESSORS = {
    NoneCompressor: None,
    FP16Compressor: torch.float16,
    BF16Compressor: torch.bfloat16,
}
# A bucket whose gradients were all sparse (sent on their own): nothing to wait for.
_NOTHING_SENT = Pending(lambda: None)


class Bucket:
    """Parameters reduced together, in one of three forms: a flat buffer whose views are the
    gradients (``flat``), one parameter reduced in its own ``.grad`` (``direct``), or a grouped
    allreduce of the (compressed) gradients (neither: custom compressors, mixed dtypes)."""

    __slots__ = (
        "params",
        "name",
        "flat",
        "views",
        "comp",
        "direct",
        "remaining",
        "sent",
        "sparse_dense",
        "compressed",
        "skip",
        "residuals",
    )

    def __init__(self, params: List[torch.Tensor], name: str) -> None:
        self.params = params
        self.name = name
        self.flat: Optional[torch.Tensor] = None  # the flat gradient buffer
        self.views: Optional[List[torch.Tensor]] = None  # per-parameter views of ``flat``
        self.comp: Optional[torch.Tensor] = None  # persistent fp16/bf16 buffer
        self.direct = False  # one parameter, reduced in its own .grad
        self.remaining = len(params)  # gradients still to come before the bucket is sent
        # This round: the dense tensor each parameter's gradient is reduced in (None: not yet,
        # or sent on its own).
        self.sent: List[Optional[torch.Tensor]] = [None] * len(params)
        self.sparse_dense: Dict[torch.Tensor, torch.Tensor] = {}  # sparse grads sent densely
        # A custom compressor's (compressor, [(parameter, compressed, context)]) of the round.
        self.compressed: Optional[Tuple[Any, List[Tuple[torch.Tensor, torch.Tensor, Any]]]] = None
        self.skip: set = set()  # sparse grads sent on their own this round (not yet moved out)
        self.residuals: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # error feedback

    def reset(self) -> None:
        self.remaining = len(self.params)
        self.sent = [None] * len(self.params)
        self.sparse_dense.clear()
        self.compressed = None
        self.skip.clear()


def gradient_tensor(
    p: torch.Tensor,
    view: Optional[torch.Tensor],
    sparse_as_dense: bool,
    sparse_dim: Optional[int] = None,
) -> torch.Tensor:
    """``p``'s gradient as it is sent, from ``p.grad``. Sparse: a sparse gradient (unless
    ``sparse_as_dense``), or any gradient of a parameter known to have sparse ones (``sparse_dim``
    given; empty where this rank has none, so that the allgathers still match). Dense otherwise:
    in ``view`` (its slot of a flat bucket, which ``p.grad`` becomes) or as it is (contiguous),
    zeros where this rank has no gradient (other ranks may have one), a sparse gradient's dense
    copy with ``sparse_as_dense`` (``p.grad`` stays sparse)."""
    g = p.grad
    if sparse_dim is not None:
        if g is None:
            # No gradient on this rank: contribute an empty sparse tensor, so that the
            # allgathers still match the other ranks' (Horovod would send dense zeros here).
            g = p.grad = torch.sparse_coo_tensor(
                torch.zeros((sparse_dim, 0), dtype=torch.int64, device=p.device),
                torch.zeros((0,) + tuple(p.shape[sparse_dim:]), dtype=p.dtype, device=p.device),
                p.shape,
            )
        elif not g.is_sparse:
            g = g.to_sparse(sparse_dim)
        return g
    if g is None:
        # Not computed here, but other ranks may have computed it.
        if view is None:
            g = torch.zeros_like(p, memory_format=torch.contiguous_format)
        else:
            g = view.zero_()
        p.grad = g
        return g
    if g.is_sparse:
        if not sparse_as_dense:
            return g
        return g.to_dense() if view is None else view.zero_().add_(g)
    if view is None:
        if not g.is_contiguous():  # e.g. channels_last: the core needs one dense block
            g = p.grad = g.contiguous()
        return g
    if g.data_ptr() != view.data_ptr():
        view.copy_(g)
        p.grad = view
    return view


def _finish(b: Bucket, _out: Any) -> None:
    """The bucket's reduced values (reduced in place) where the optimizer reads them: out of
    the low-precision buffer, decompressed, back to sparse (sparse_as_dense)."""
    if b.comp is not None:
        target = b.flat if b.flat is not None else b.sent[0]
        if target is not None:  # None: waited for after the round was dropped
            target.copy_(b.comp)
    elif b.compressed is not None:
        compression, compressed = b.compressed
        b.compressed = None
        for p, tc, ctx in compressed:
            out = compression.decompress(tc, ctx)
            if p in b.sparse_dense:
                b.sparse_dense[p] = out
            elif out is not p.grad:
                p.grad.set_(out)
    for p, dense in b.sparse_dense.items():
        # sparse_as_dense: the gradient goes back to sparse before the update.
        p.grad.zero_().add_(dense if dense.is_sparse else dense.to_sparse())
    b.sparse_dense.clear()


def _finish_sparse(p: torch.Tensor, aggregated: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if g.is_sparse:
        # Sparse grads do not support set_, so this is the equivalent.
        g.zero_().add_(aggregated)
    else:
        p.grad = aggregated
    return aggregated


class Buckets:
    """One DistributedOptimizer's gradient buckets: their layout, their flat buffers, and the
    reductions, started as gradients become ready (:meth:`ready`) or by synchronize()
    (:meth:`launch_missing`), through one launch path (:meth:`launch`); each pending reduction
    goes to ``handles`` (the optimizer's ``_handles``) under its bucket, or its parameter for a
    sparse gradient sent on its own. ``delay``: the optimizer's countdown of backward passes per
    parameter. ``impl``: a BAGUA algorithm's implementation, asked first to send each bucket.
    Refers to nothing that refers to the optimizer when ``impl`` is None, so that :meth:`ready`
    is itself the gradient hook."""

    def __init__(
        self,
        params: List[torch.Tensor],
        names: Dict[torch.Tensor, str],
        handles: Dict[Any, Pending],
        delay: Dict[torch.Tensor, int],
        process_set: ProcessSet,
        reduction: Tuple[int, float, float],
        compression: Any,
        sparse_as_dense: bool,
        groups: Any,
        cap: int,
        impl: Any,
    ) -> None:
        self.params = params  # in param_groups order
        self.names = names
        self.handles = handles
        self.delay = delay
        self.process_set = process_set
        self.op, self.prescale, self.postscale = reduction
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.groups = groups
        self.cap = cap
        self.impl = impl
        self.cast_dtype = _CAST_COMPRESSORS.get(compression, False)
        self.buckets: List[Bucket] = []
        self.by_param: Dict[torch.Tensor, Tuple[Bucket, int]] = {}  # bucket, index in it
        self.sparse: set = set()  # known sparse (allgather path), outside buckets
        self.sparse_dims: Dict[torch.Tensor, int] = {}
        self.layout_final = False
        if groups is not None:
            p_groups = self._form_groups(params)
        else:
            p_groups = self._form_buckets(list(reversed(params)), set())
        self._set_buckets(p_groups)
        self._flatten_all()
        self.observed: Optional[List[torch.Tensor]] = []  # ready order during step 1

    # ---- the reductions ------------------------------------------------------------------------
    def key(self, p: torch.Tensor) -> Any:
        """What ``p``'s reduction is pending under in ``handles``."""
        entry = self.by_param.get(p)
        return p if entry is None else entry[0]

    def ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient has been accumulated (a backward pass). After the last of the
        step's passes it is final: into its bucket, whose reduction starts with its last
        gradient (a known sparse one goes on its own); before, it accumulates locally and the
        pending marker makes zero_grad() refuse. With an algorithm, it speaks first."""
        impl = self.impl
        if impl is not None and impl.gradient_hook(p):
            return
        d = self.delay[p]
        if d <= 0:
            raise AssertionError(TOO_MANY_PASSES_MESSAGE)
        assert not p.grad.requires_grad
        self.delay[p] = d - 1
        if d > 1:
            self.handles.setdefault(self.key(p), NOT_STARTED)
            return
        if self.observed is not None:
            self.observed.append(p)
        entry = self.by_param.get(p)
        if entry is None:
            self._send_sparse(p)
            return
        b, i = entry
        self._place(b, i, p)
        b.remaining -= 1
        if b.remaining:
            self.handles.setdefault(b, NOT_STARTED)
        else:
            self.launch(b)

    def launch_missing(self) -> None:
        """Starts the reductions whose gradients did not all arrive through the hooks (unused
        parameters, fewer backward passes), with what ``p.grad`` holds."""
        handles = self.handles
        for b in self.buckets:
            if not handles.get(b, NOT_STARTED).started:
                self.launch(b, fill=True)
        for p in self.sparse:
            if not handles.get(p, NOT_STARTED).started:
                self._send_sparse(p)

    def _place(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        """``p``'s gradient (``b.params[i]``) where bucket ``b`` reduces it, or on its own if it
        is sparse."""
        view = None if b.views is None else b.views[i]
        t = gradient_tensor(p, view, self.sparse_as_dense)
        if t.is_sparse:  # from now on outside the buckets (the layout moves it out)
            self.sparse.add(p)
            b.skip.add(p)
            self._send_sparse(p)
            return
        b.sent[i] = t
        if p.grad.is_sparse:  # sparse_as_dense: sparse again after the reduction
            b.sparse_dense[p] = t

    def launch(self, b: Bucket, fill: bool = False) -> None:
        """Starts the bucket's allreduce: the bucket's form decides what is sent, the algorithm
        (if any) which primitive sends it. ``fill``: from synchronize(), so gradients that did
        not arrive through the hook are taken from ``p.grad`` as they are, or zeros."""
        if fill:
            for i, p in enumerate(b.params):
                if p not in b.skip:
                    self._place(b, i, p)
        if b.flat is not None:
            tensors = [b.flat]
        else:
            tensors = [t for t in b.sent if t is not None]
            if not tensors:  # only sparse gradients, sent on their own
                self.handles[b] = _NOTHING_SENT
                return
        impl = self.impl
        if impl is not None and (b.flat is not None or b.direct):
            name = _ops.op_name("allreduce", b.name)
            request = impl.launch(
                b.params, tensors[0], name, b, self.op, self.prescale, self.postscale
            )
            if request is not None:
                self.handles[b] = Pending(request, _finish, b)
                return
        sent = tensors
        b.compressed = None
        if b.comp is not None:
            b.comp.copy_(tensors[0])
            sent = [b.comp]
        elif b.flat is None and not b.direct and self.compression is not NoneCompressor:
            # Each gradient compressed on its own (Horovod's semantics).
            compression = self.compression
            compressed = [
                (p, *compression.compress(t)) for p, t in zip(b.params, b.sent) if t is not None
            ]
            b.compressed = (compression, compressed)
            sent = [tc for _, tc, _ in compressed]
        urgent = self.cap > 0 or self.groups is not None
        if all(t.is_cpu for t in sent):
            # Straight to the core, in place (the path of docs/design-core.md's hop count).
            descs = mpi_ops.host_allreduce_descs(sent, self.op, self.prescale, self.postscale)
            name = _ops.op_name("allreduce" if len(sent) == 1 else "grouped_allreduce", b.name)
            handle, keep = _ops.enqueue(
                _ops.OP_ALLREDUCE,
                descs,
                descs,
                name=name,
                process_set_id=_ops.process_set_id(self.process_set),
                reduce_op=self.op,
                prescale_factor=self.prescale,
                postscale_factor=self.postscale,
                urgent=urgent,
            )
            mpi_ops.track(handle, (keep, sent), name)
        else:
            handle = mpi_ops.bucket_allreduce_async(
                sent, b.name, self.op, self.prescale, self.postscale, self.process_set, urgent
            )
        self.handles[b] = Pending(handle, _finish, b)

    def _send_sparse(self, p: torch.Tensor) -> None:
        t = gradient_tensor(p, None, False, self.sparse_dims.get(p, 1))
        if p.grad.is_sparse:
            self.sparse_dims[p] = p.grad.sparse_dim()
        wait = mpi_ops.sparse_allreduce_async(
            t, name=self.names.get(p), op=self.op, process_set=self.process_set
        )
        self.handles[p] = Pending(wait, _finish_sparse, p)

    def reset_round(self) -> None:
        for b in self.buckets:
            b.reset()

    # ---- layout ----------------------------------------------------------------------------------
    def plan_again(self) -> None:
        """A new job was formed (an elastic reset): agree on the layout again at the next step,
        as the workers that just joined do at their first; residuals belonged to the old job."""
        self.layout_final = False
        self.observed = []
        for b in self.buckets:
            b.residuals = None

    def finalize(self) -> None:
        """After the first step: rebuild the buckets in the observed ready order (rank 0's) and
        move sparse gradients out of them, if that changes the first guess (the gradients are
        then copied into the new buffers)."""
        params = self.params
        n = len(params)
        index = {p: i for i, p in enumerate(params)}
        observed = self.observed or []
        self.observed = None
        order_idx = [index[p] for p in observed if p in index]
        seen = set(order_idx)
        order_idx += [i for i in reversed(range(n)) if i not in seen]
        # One allreduce(Max) carries rank 0's order (others send zeros) and every rank's
        # sparse flags.
        info = torch.zeros(2 * n, dtype=torch.int64)
        if self.process_set.rank() == 0 and n:
            info[:n] = torch.tensor(_positions(order_idx, n), dtype=torch.int64)
        for p in self.sparse:
            info[n + index[p]] = 1
        info = mpi_ops.allreduce(
            info,
            name="DistributedOptimizer.layout",
            op=mpi_ops.Max,
            process_set=self.process_set,
        )
        pos = info[:n].tolist()
        sparse_flags = info[n:].tolist()
        sparse = {params[i] for i in range(n) if sparse_flags[i]}
        if not self.sparse_as_dense:
            self.sparse = sparse
        if self.groups is None:
            order = [params[i] for i in sorted(range(n), key=lambda i: pos[i])]
            groups = self._form_buckets(order, self.sparse)
        else:
            groups = [[p for p in b.params if p not in self.sparse] for b in self.buckets]
            groups = [g for g in groups if g]
        self.layout_final = True
        if [[id(p) for p in g] for g in groups] == [
            [id(p) for p in b.params] for b in self.buckets
        ]:
            return  # the first guess was right
        # New buckets: new flat buffers (the gradients are copied over, the old buffers freed).
        self._set_buckets(groups)
        self._flatten_all()

    def _form_groups(self, p_list: List[torch.Tensor]) -> List[List[torch.Tensor]]:
        # The same parameter order and groups on every rank: rank 0's order of names.
        names = [self.names.get(p) for p in p_list]
        root_names = _broadcast_names(names, self.process_set)
        p_list = sorted(p_list, key=lambda p: root_names.index(self.names.get(p)))
        if isinstance(self.groups, list):
            p_groups = []
            grouped_id = set()
            p_list_ids = {id(p) for p in p_list}
            for group in self.groups:
                p_groups.append([p for p in group if id(p) in p_list_ids])
                for p in p_groups[-1]:
                    grouped_id.add(id(p))
            for p in p_list:
                if id(p) not in grouped_id:
                    p_groups.append([p])
        else:
            p_groups = split_list(p_list, self.groups)
        return [list(g) for g in p_groups if len(g)]

    def _form_buckets(self, order: List[torch.Tensor], sparse: set) -> List[List[torch.Tensor]]:
        """Cuts ``order`` into buckets of at most the cap, one (dtype, device) per bucket."""
        params = [p for p in order if p not in sparse]
        infos = [(p.numel(), (p.dtype, p.device), p.element_size()) for p in params]
        layout = engine.bucket_layout(infos, self.cap, order=range(len(params)))
        return [[params[i] for i in b] for b in layout]

    def _set_buckets(self, p_groups: List[List[torch.Tensor]]) -> None:
        self.buckets = []
        self.by_param = {}
        for g in p_groups:
            b = Bucket(g, engine.bucket_label(self.names.get(g[0]), len(g)))
            self.buckets.append(b)
            for i, p in enumerate(g):
                self.by_param[p] = (b, i)

    def _flatten_all(self) -> None:
        if self.cast_dtype is not False:  # element-wise compression (or none)
            for b in self.buckets:
                self._flatten(b)

    def _flatten(self, b: Bucket) -> None:
        p0 = b.params[0]
        dtype, device = p0.dtype, p0.device
        cast = self.cast_dtype
        if len(b.params) == 1:
            # Nothing to fuse: reduce the gradient itself, in place, without a copy into a
            # buffer (no copy, and no second gradient-sized buffer).
            b.direct = True
            if cast is not None and dtype.is_floating_point and dtype != cast:
                b.comp = torch.empty(p0.shape, dtype=cast, device=device)
            return
        if any(p.dtype != dtype or p.device != device for p in b.params):
            return  # mixed bucket (user groups): stays a grouped allreduce
        total = sum(p.numel() for p in b.params)
        flat = torch.zeros(total, dtype=dtype, device=device)
        views = []
        off = 0
        with torch.no_grad():
            for p in b.params:
                k = p.numel()
                view = flat[off : off + k].view(p.shape)
                off += k
                g = p.grad
                if g is not None:
                    if g.is_sparse:
                        view.add_(g)
                    else:
                        view.copy_(g)
                        p.grad = view
                views.append(view)
        b.flat = flat
        b.views = views
        if cast is not None and dtype.is_floating_point and dtype != cast:
            b.comp = torch.empty(total, dtype=cast, device=device)


def _positions(order_idx: List[int], n: int) -> List[int]:
    pos = [0] * n
    for k, i in enumerate(order_idx):
        pos[i] = k
    return pos


def _broadcast_names(names: List[Optional[str]], process_set: ProcessSet) -> List[Optional[str]]:
    """Rank 0's list of names (process-set rank 0), on every rank of the set."""
    root = process_set.ranks[0] if process_set.ranks else 0
    data = torch.tensor(list(json.dumps(names).encode("utf-8")), dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64)
    length = mpi_ops.broadcast(
        length, root, name="DistributedOptimizer.groups.size", process_set=process_set
    )
    buf = torch.zeros(int(length[0]), dtype=torch.uint8)
    if process_set.rank() == 0:
        buf = data
    buf = mpi_ops.broadcast(
        buf, root, name="DistributedOptimizer.groups.names", process_set=process_set
    )
    return json.loads(bytes(buf.tolist()).decode("utf-8"))
