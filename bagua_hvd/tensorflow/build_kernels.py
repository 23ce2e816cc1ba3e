"""``python -m bagua_hvd.tensorflow.build_kernels``: builds bagua_hvd's TensorFlow kernels now
(for example while a container image is made, so that the first job does not) and prints the
library's path; exit status 1, with the reason, where they cannot be built (kernels.py)."""

from __future__ import annotations

import sys

import tensorflow as tf

import bagua_hvd.tensorflow.kernels as kernels


def main() -> int:
    try:
        path = kernels._library_path()
        tf.load_op_library(str(path))
    except Exception as e:  # noqa: BLE001 - report whatever stopped the build
        print(f"bagua_hvd: cannot build the TensorFlow kernels: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
