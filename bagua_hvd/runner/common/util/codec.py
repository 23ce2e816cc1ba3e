"""Horovod's ``horovod.runner.common.util.codec``: objects as base64 text (cloudpickle)."""

from __future__ import annotations

import base64
import pickle
from typing import Any, Union


def dumps_base64(obj: Any, to_ascii: bool = True) -> Union[str, bytes]:
    """``obj`` pickled with cloudpickle, in base64 (a str when ``to_ascii``, else bytes)."""
    import cloudpickle

    encoded = base64.b64encode(cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return encoded.decode("ascii") if to_ascii else encoded


def loads_base64(encoded: Union[str, bytes]) -> Any:
    """The object :func:`dumps_base64` encoded."""
    import cloudpickle

    return cloudpickle.loads(base64.b64decode(encoded))
