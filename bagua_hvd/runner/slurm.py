"""``bagua-run`` inside a Slurm allocation: its hosts and slots, when no -H/--hostfile is given.

Slurm describes the allocation in the batch script's environment: ``SLURM_JOB_NODELIST`` in
its compressed form (``node[01-04,07],gpu5``) and the tasks per node (``SLURM_TASKS_PER_NODE``,
``2(x3),1``; ``SLURM_JOB_CPUS_PER_NODE`` when no task count was requested). The ranks are then
started on those nodes over ssh like any -H host list (Slurm lets a job's user ssh to the
job's nodes).
"""

from __future__ import annotations

import os
import re
from typing import List, Mapping, Optional, Tuple

from bagua_hvd.runner.hosts import HostError


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


def allocation(environ: Optional[Mapping[str, str]] = None) -> Optional[List[Tuple[str, int]]]:
    """(host, slots) of the Slurm allocation this process runs in, None outside one."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    counts_text = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_CPUS_PER_NODE")
    counts = expand_counts(counts_text) if counts_text else [1] * len(hosts)
    if len(counts) != len(hosts):
        raise HostError(
            f"Slurm lists {len(hosts)} nodes ({nodelist}) but {len(counts)} per-node counts "
            f"({counts_text})"
        )
    return list(zip(hosts, counts))
