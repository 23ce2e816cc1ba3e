"""Host-list notation read by the launcher and by the ranks: Slurm's compressed node list
(``node[01-04,07],gpu5``) and per-node counts (``2(x3),1``), and the error for a host list that
cannot be used. ``bagua-run`` reads them from an allocation (runner/slurm.py), ranks started by
srun without MPI from their job step (common/bootstrap.py).
"""

from __future__ import annotations

import re
from typing import List


class HostError(ValueError):
    """A host list that the launcher cannot use."""


def _split_top(text: str) -> List[str]:
    """Splits at the commas that are outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostError(f"unbalanced ']' in Slurm node list {text!r}")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise HostError(f"unbalanced '[' in Slurm node list {text!r}")
    return out + [cur]


def expand_nodelist(text: str) -> List[str]:
    """Slurm's compressed host list, expanded in order: ``n[1-3,07]x`` -> n1x, n2x, n3x, n07x
    (a range keeps the zero padding of its bounds); several bracket groups multiply."""
    hosts: List[str] = []
    for item in _split_top(text.strip()):
        if not item:
            raise HostError(f"empty entry in Slurm node list {text!r}")
        m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", item)
        if m is None:
            hosts.append(item)
            continue
        prefix, ranges, rest = m.groups()
        tails = expand_nodelist(rest) if rest else [""]
        for part in ranges.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()):
                raise HostError(f"bad range {part!r} in Slurm node list {text!r}")
            width = len(lo)
            for i in range(int(lo), int(hi if dash else lo) + 1):
                hosts += [f"{prefix}{i:0{width}d}{tail}" for tail in tails]
    return hosts


def expand_counts(text: str) -> List[int]:
    """Slurm's per-node counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    out: List[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise HostError(f"bad Slurm per-node count {item!r} in {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out
