"""Training helpers (``horovod.torch.functions``): broadcast a model's parameters, an optimizer's
state and arbitrary Python objects, and gather Python objects from every rank.

Differences from Horovod 0.28.1, all of them fixes:

* ``broadcast_optimizer_state`` sends every non-tensor value (scalar state such as SparseAdam's
  integer ``step``, and every param-group option: ``lr``, ``betas`` tuples, ``None`` flags such
  as ``foreach``, Adafactor's ``eps=(None, 1e-3)``) with one ``broadcast_object``; Horovod
  packs options into ``torch.Tensor([value])``, which fails on ``None`` and nested tuples.
  Tensors, including the tensor-valued ``step`` of current torch, are broadcast in place.
* The step that initialises an empty state leaves the parameters and their ``.grad`` as they
  were (Horovod leaves zero gradients, and weight decay moves the parameters).
* The root's state layout is the reference: a rank that lacks a state entry gets one, so a rank
  whose state differs in layout from the root's ends equal to it instead of hanging.
* ``torch.optim.SparseAdam`` is supported: its empty state is initialised with an empty sparse
  gradient (Horovod's dense zero gradient makes SparseAdam raise).
* ``allgather_object`` slices the gathered bytes at cumulative offsets (Horovod's slicing is
  only right for up to two ranks) and object sizes are 64-bit.
"""

from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import cloudpickle
import torch

from bagua_hvd.torch.mpi_ops import (
    Min,
    ProcessSet,
    allgather,
    allreduce,
    broadcast_,
    broadcast_async_,
    global_process_set,
    rank,
    size,
    synchronize,
)

__all__ = [
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
]

_DIST_OPTIMIZER_MODULE = "bagua_hvd.torch.optimizer"


# ---- tensors ------------------------------------------------------------------------------------
def _wire_view(t: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The tensor the core broadcasts in place, and the tensor to copy it back into (or None).

    Complex tensors travel as their real view; non-contiguous ones through a contiguous copy.
    """
    target = t.detach()
    wire = torch.view_as_real(target) if target.is_complex() else target
    if wire.is_contiguous():
        return wire, None
    return wire.contiguous(), wire


def _broadcast_tensors_(entries: List[Tuple[Optional[str], torch.Tensor]], root_rank: int) -> None:
    """Broadcasts every tensor in place (asynchronously), then waits for all of them."""
    pending = []
    for name, t in entries:
        wire, copy_back = _wire_view(t)
        pending.append((broadcast_async_(wire, root_rank, name), wire, copy_back))
    for handle, wire, copy_back in pending:
        synchronize(handle)
        if copy_back is not None:
            with torch.no_grad():
                copy_back.copy_(wire)


def broadcast_parameters(params: Union[Dict[str, torch.Tensor], List[Any]], root_rank: int) -> None:
    """Broadcasts the parameters from root rank to all other processes.

    Typical usage is to broadcast the ``model.state_dict()``, ``model.named_parameters()``, or
    ``model.parameters()``.

    Arguments:
        params: One of the following:
            - list of parameters to broadcast
            - dict of parameters to broadcast
        root_rank: The rank of the process from which parameters will be broadcasted to all
            other processes.

    A dict is broadcast in key order (names ``broadcast.<key>``); a list may hold tensors or
    ``(name, tensor)`` tuples. Anything else raises ``ValueError('invalid params of type: %s')``.
    The tensors are updated in place on every rank but the root; non-contiguous tensors are
    staged through a contiguous copy.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        # support both named_parameters() and regular parameters()
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    _broadcast_tensors_(list(items), root_rank)


# ---- Python objects -----------------------------------------------------------------------------
def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    cloudpickle.dump(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return cloudpickle.loads(data.numpy().tobytes())


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Serializes and broadcasts an object from root rank to all other processes.

    Typical usage is to broadcast the ``optimizer.state_dict()``, for example::

        state_dict = broadcast_object(optimizer.state_dict(), 0)
        if hvd.rank() > 0:
            optimizer.load_state_dict(state_dict)

    Arguments:
        obj: An object capable of being serialized without losing any context.
        root_rank: The rank of the process from which parameters will be broadcasted to all
            other processes (a global rank, also inside a process set).
        name: Optional name to use during broadcast, will default to the class type.
        process_set: Process set object to limit this operation to a subset of Horovod
            processes. Default is the global process set.

    Returns:
        The object that was broadcast from the ``root_rank`` (the root gets ``obj`` itself).

    The object is serialized with cloudpickle; its length is broadcast as ``<name>.sz`` and the
    bytes as ``<name>.t``.
    """
    if name is None:
        name = type(obj).__name__
    if rank() == root_rank:
        t = _to_bytes_tensor(obj)
        sz = torch.tensor([t.numel()], dtype=torch.int64)
        broadcast_(sz, root_rank, name + ".sz", process_set)
    else:
        sz = torch.zeros(1, dtype=torch.int64)
        broadcast_(sz, root_rank, name + ".sz", process_set)
        t = torch.empty(int(sz.item()), dtype=torch.uint8)
    broadcast_(t, root_rank, name + ".t", process_set)
    if rank() != root_rank:
        obj = _from_bytes(t)
    return obj


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Serializes and allgathers an object from all other processes.

    Arguments:
        obj: An object capable of being serialized without losing any context.
        name: Optional name to use during allgather, will default to the class type.

    Returns:
        The list of objects that were allgathered across all ranks (``size()`` of them, in rank
        order).

    The object is serialized with cloudpickle; the lengths are gathered as ``<name>.sz`` and the
    bytes as ``<name>.t``.
    """
    if name is None:
        name = type(obj).__name__
    t = _to_bytes_tensor(obj)
    sizes = allgather(torch.tensor([t.numel()], dtype=torch.int64), name=name + ".sz").tolist()
    gathered = allgather(t, name=name + ".t")
    out = []
    start = 0
    for n in sizes:
        out.append(_from_bytes(gathered[start : start + n]))
        start += n
    if len(out) != size():
        raise RuntimeError(f"allgather_object: expected {size()} objects, got {len(out)}")
    return out


# ---- optimizer state ----------------------------------------------------------------------------
def _is_distributed_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__ == _DIST_OPTIMIZER_MODULE


def _local_step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` without communication.

    DistributedOptimizer's step would allreduce every gradient; call the step of the first class
    in the MRO that is not defined in bagua_hvd.torch.optimizer (the wrapped optimizer's).
    """
    if not _is_distributed_optimizer(optimizer):
        optimizer.step()
        return
    for cls in type(optimizer).__mro__:
        if cls.__module__ != _DIST_OPTIMIZER_MODULE and "step" in cls.__dict__:
            cls.__dict__["step"](optimizer)
            return
    raise TypeError(f"cannot find the wrapped optimizer's step() in {type(optimizer).__mro__}")


# Parameters initialised per step() in _initialize_state: bounds the transient copies.
_INIT_CHUNK_BYTES = 32 << 20


def _initialize_state(optimizer: torch.optim.Optimizer, sparse_ids: Set[int]) -> None:
    """Horovod's state initialisation, one ``step()`` on zero gradients. The parameters are
    restored afterwards; the zero gradients stay, as in Horovod (sparse for ``SparseAdam`` and
    for ``SGD`` on the parameters in ``sparse_ids``).

    The step runs over chunks of about 32 MiB of parameters (the optimizer's param groups
    temporarily narrowed to the chunk; torch's optimizers other than LBFGS update each parameter
    independently), so the saved parameters and zero gradients never take more than a chunk's
    worth of memory at a time instead of twice the model's size."""
    sparse_step = isinstance(optimizer, torch.optim.SparseAdam)
    # SGD steps on dense zeros, so a momentum buffer stays dense (a sparse one cannot be
    # broadcast); its sparse parameters are then left with sparse zeros, Horovod's layout.
    sparse_after = sparse_ids if isinstance(optimizer, torch.optim.SGD) else set()

    original = optimizer.param_groups
    chunks: List[List[Tuple[int, torch.Tensor]]] = [[]]
    nbytes = 0
    for gi, group in enumerate(original):
        for p in group["params"]:
            if not p.requires_grad:
                continue
            if nbytes >= _INIT_CHUNK_BYTES:
                chunks.append([])
                nbytes = 0
            chunks[-1].append((gi, p))
            nbytes += p.numel() * p.element_size()
    try:
        for chunk in chunks:
            if not chunk:
                continue
            members: Dict[int, List[torch.Tensor]] = {}
            for gi, p in chunk:
                members.setdefault(gi, []).append(p)
            # Same option dicts (a step that updates an option updates the real group), fewer
            # parameters.
            optimizer.param_groups = [
                _NarrowedGroup(original[gi], ps) for gi, ps in members.items()
            ]
            saved = []
            for _, p in chunk:
                saved.append((p, p.detach().clone()))
                p.grad = torch.zeros_like(p).to_sparse() if sparse_step else torch.zeros_like(p)
            try:
                _local_step(optimizer)
            finally:
                with torch.no_grad():
                    for p, value in saved:
                        p.copy_(value)
                        if id(p) in sparse_after:
                            p.grad = torch.zeros_like(p).to_sparse()
                        elif not p.grad.is_sparse:
                            p.grad.zero_()  # zero even if a step wrote to it
                del saved
    finally:
        optimizer.param_groups = original


class _NarrowedGroup(dict):
    """A param group restricted to some of its parameters that writes option changes through
    to the original group."""

    def __init__(self, group: Dict[str, Any], params: List[torch.Tensor]):
        super().__init__(group)
        self._group = group
        dict.__setitem__(self, "params", params)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if key != "params":
            self._group[key] = value


def _tensor_spec(t: torch.Tensor, p: Optional[torch.Tensor]) -> Tuple[Any, ...]:
    on_param_device = p is not None and t.device == p.device
    return ("tensor", tuple(t.shape), t.dtype, on_param_device)


def _conform(
    container: Dict[Any, Any], key: Any, spec: Tuple[Any, ...], p: Optional[torch.Tensor]
) -> Optional[torch.Tensor]:
    """Makes ``container[key]`` match the root's spec: a scalar is set (the caller sets it), a
    tensor of the root's shape and dtype is kept or allocated. Returns the tensor, if any."""
    if spec[0] != "tensor":
        return None
    _, shape, dtype, on_param_device = spec
    cur = container.get(key)
    if isinstance(cur, torch.Tensor) and tuple(cur.shape) == shape and cur.dtype == dtype:
        return cur
    if isinstance(cur, torch.Tensor):
        device = cur.device
    elif on_param_device and p is not None:
        device = p.device
    else:
        device = torch.device("cpu")
    container[key] = torch.empty(shape, dtype=dtype, device=device)
    return container[key]


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Optional[torch.nn.Module] = None
) -> None:
    """Broadcasts an optimizer state from root rank to all other processes.

    Arguments:
        optimizer: An optimizer (a ``torch.optim.Optimizer`` or a ``DistributedOptimizer``).
        root_rank: The rank of the process from which the optimizer will be broadcasted to all
            other processes.
        model: (Optional) the model the optimizer trains, used to identify sparse parameters
            and to name the broadcasts (``<parameter name>.<state key>``) for the timeline;
            default None.

    Every ``torch.optim`` optimizer is supported except ``torch.optim.LBFGS``
    (``ValueError('cannot broadcast torch.optim.LBFGS state')``). A rank whose state is empty
    first initialises it with one ``step()`` on zero gradients (without communication for a
    DistributedOptimizer). As in Horovod, those zero gradients stay: afterwards every parameter
    that requires grad has a zero ``.grad`` (sparse for ``SparseAdam``, and for ``SGD`` on a
    sparse ``Embedding`` of ``model``), and the others keep theirs; unlike Horovod's, the step
    leaves the parameters as they were (weight decay on zero gradients would move them). Then the
    root's param-group options and non-tensor state go to every rank through one
    ``broadcast_object``, and every state tensor is broadcast in place. Afterwards every rank's
    ``optimizer.state`` and ``optimizer.param_groups`` options equal the root's.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        # L-BFGS state is deeply nested (history lists, None values): not supported, as in
        # Horovod.
        raise ValueError("cannot broadcast torch.optim.LBFGS state")

    # Newly created optimizers will not have their state initialized, so do that
    # initialization here (as Horovod: one step on zero gradients).
    if len(optimizer.state) == 0:
        sparse_ids = set()
        if model is not None:
            for m in model.modules():
                if isinstance(m, torch.nn.Embedding) and m.sparse:
                    sparse_ids.update(id(p) for p in m.parameters())
        _initialize_state(optimizer, sparse_ids)

    names: Dict[int, str] = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters()}

    groups = optimizer.param_groups
    params = [p for g in groups for p in g["params"]]

    # The layout and the non-tensor values, as the root sees them.
    layout: Dict[str, Any] = {
        "n_params": [len(g["params"]) for g in groups],
        "shapes": [tuple(p.shape) for p in params],
        "groups": [],
        "state": {},
    }
    for g in groups:
        opts = {}
        for k, v in g.items():
            if k == "params":
                continue
            opts[k] = _tensor_spec(v, None) if torch.is_tensor(v) else ("value", v)
        layout["groups"].append(opts)
    for i, p in enumerate(params):
        st = optimizer.state.get(p)
        if not st:
            continue
        layout["state"][i] = {
            k: _tensor_spec(v, p) if torch.is_tensor(v) else ("value", v) for k, v in st.items()
        }

    root = broadcast_object(
        layout if rank() == root_rank else None, root_rank, name="broadcast_optimizer_state.layout"
    )

    # Same parameters everywhere? Every rank learns whether any rank differs, and all raise.
    ok = root["n_params"] == layout["n_params"] and root["shapes"] == layout["shapes"]
    all_ok = allreduce(
        torch.tensor([int(ok)], dtype=torch.int32), op=Min, name="broadcast_optimizer_state.check"
    )
    if int(all_ok.item()) != 1:
        where = "this rank's" if not ok else "another rank's"
        raise ValueError(
            "broadcast_optimizer_state: the optimizer's parameters differ between ranks "
            f"({where} param_groups do not match root rank {root_rank}'s: parameters per group "
            f"{layout['n_params']} vs {root['n_params']})"
        )

    entries: List[Tuple[Optional[str], torch.Tensor]] = []
    for gi, (g, opts) in enumerate(zip(groups, root["groups"])):
        for k, spec in opts.items():
            t = _conform(g, k, spec, None)
            if t is None:
                g[k] = spec[1]
            else:
                entries.append((f"broadcast_optimizer_state.group.{gi}.{k}", t))
        for k in [k for k in g if k != "params" and k not in opts]:
            del g[k]
    for i, p in enumerate(params):
        specs = root["state"].get(i)
        if specs is None:
            optimizer.state.pop(p, None)
            continue
        st = optimizer.state[p]
        for k in [k for k in st if k not in specs]:
            del st[k]
        for k, spec in specs.items():
            t = _conform(st, k, spec, p)
            if t is None:
                st[k] = spec[1]
            else:
                pname = names.get(id(p), str(i))
                entries.append((f"broadcast_optimizer_state.{pname}.{k}", t))
        if list(st) != list(specs):  # the root's key order
            ordered = {k: st[k] for k in specs}
            st.clear()
            st.update(ordered)

    _broadcast_tensors_(entries, root_rank)
