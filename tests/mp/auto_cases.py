"""algorithm="auto" with a decentralized candidate: the cases tests/mp/test_torch_auto.py and
tests/mp/test_tf_auto.py share (the declarations are the same classes in every frontend)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Tuple

from bagua_hvd.common import algorithms as A

# name (tests/reference_algorithms.py's) -> the candidate and the reference's arguments
_DECENTRALIZED: Dict[str, Tuple[Callable[[], A.Algorithm], Dict[str, Any]]] = {
    "decentralized": (
        lambda: A.Decentralized(peer_selection_mode="shift_one"),
        {"peer_selection_mode": "shift_one"},
    ),
    "low_precision_decentralized": (lambda: A.LowPrecisionDecentralized(), {}),
}
NAMES = sorted(_DECENTRALIZED)


class Case(NamedTuple):
    """``Auto([GradientAllReduce(), decentralized()])`` with ``slow`` made slow."""

    decentralized: Callable[[], A.Algorithm]
    slow: str  #: the class name the test hook delays
    expected: str  #: the class name that must be chosen
    chosen: int  #: its index among the candidates
    reference: str  #: tests/reference_algorithms.py's name of the chosen algorithm
    reference_kwargs: Dict[str, Any]


def case(name: str, slow_decentralized: bool) -> Case:
    """The case of the decentralized candidate ``name``, it or GradientAllReduce made slow."""
    make, kwargs = _DECENTRALIZED[name]
    dec_class = type(make()).__name__
    if slow_decentralized:
        return Case(make, dec_class, "GradientAllReduce", 0, "gradient_allreduce", {})
    return Case(make, "GradientAllReduce", dec_class, 1, name, kwargs)


def schedule(chosen: int, warmup: int, per: int, rounds: int, after: int) -> List[Tuple[int, bool]]:
    """(candidate, final) of each step by docs/algorithms.md's schedule of two candidates:
    the first in warm-up, each round the first's measurement then the second's, then the
    choice."""
    measuring = [(0, False)] * warmup + (
        [(0, False)] * (per + 1) + [(1, False)] * (per + 1)
    ) * rounds
    return measuring + [(chosen, True)] * after
