"""Horovod's ``horovod.runner.common``: the helpers launcher scripts import (``util``)."""
