"""One rank of ``bagua_hvd.run``: ``python -m bagua_hvd.runner.task JOB_DIR``.

Loads ``(func, args, kwargs)`` from ``JOB_DIR/func.pkl`` (cloudpickle), calls it and stores
``("ok", result)`` or ``("error", traceback text)`` in ``JOB_DIR/result.<rank>.pkl``; a failure
also exits with status 1 so that the launcher stops the other ranks.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

FUNC_FILE = "func.pkl"


def result_path(job_dir: str, rank: int) -> Path:
    """Where rank ``rank`` stores its outcome."""
    return Path(job_dir) / f"result.{rank}.pkl"


def _store(job_dir: str, rank: int, outcome: tuple) -> None:
    import cloudpickle

    path = result_path(job_dir, rank)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        cloudpickle.dump(outcome, f)
    os.replace(tmp, path)  # the caller never sees a half-written result


def main(argv: list) -> int:
    """Runs the pickled function as this rank (HOROVOD_RANK); returns the exit status."""
    if len(argv) != 1:
        print("usage: python -m bagua_hvd.runner.task JOB_DIR", file=sys.stderr)
        return 2
    job_dir = argv[0]
    rank = int(os.environ.get("HOROVOD_RANK", "0"))
    try:
        import cloudpickle

        with open(Path(job_dir) / FUNC_FILE, "rb") as f:
            func, args, kwargs = cloudpickle.load(f)
        value = func(*args, **kwargs)
    except BaseException:  # noqa: B036 - SystemExit/KeyboardInterrupt in func are failures too
        text = traceback.format_exc()
        sys.stderr.write(text)
        try:
            _store(job_dir, rank, ("error", text))
        except Exception:
            pass  # the traceback is on stderr anyway
        return 1
    try:
        _store(job_dir, rank, ("ok", value))
    except Exception:
        text = traceback.format_exc()
        sys.stderr.write(f"bagua_hvd.run: rank {rank} could not pickle its result:\n{text}")
        try:
            _store(
                job_dir, rank, ("error", f"the result of rank {rank} could not be pickled:\n{text}")
            )
        except Exception:
            pass
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
