"""Per-step timeline of one rank for the plain allreduce, ByteGrad and low-precision
decentralized SGD: bench/algorithms.py with --timeline and these modes (its other options pass
through; the default network is loopback, --nets 1gbit needs root).

    python bench/timeline.py                       # loopback
    python bench/timeline.py --nets 1gbit          # shaped link, network namespaces (root)
    python bench/timeline.py --nets 1gbit --timeline 3 --steps 6

Each mode's row of the usual table, then a summary per rank and traced step and rank 0's last
traced step event by event (ms from the step's start): bucket launches, the core's collectives
(begin, ByteGrad's alltoall half, end; the low-precision local halves), the waits' returns and
the optimizer's updates (bench/_timeline.py says where each comes from).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import algorithms  # noqa: E402

DEFAULTS = {
    "--nets": "loopback",
    "--modes": "gradient_allreduce,bytegrad,low_precision_decentralized",
    "--steps": "4",
    "--timeline": "2",
    "--no-plot": None,
}


def main(argv: list[str]) -> int:
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    extra: list[str] = []
    for flag, value in DEFAULTS.items():
        if flag not in given:
            extra += [flag] if value is None else [flag, value]
    return algorithms.main(extra + argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
