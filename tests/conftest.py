"""Shared pytest configuration.

tests/mp/ holds tests that run inside the launcher (one pytest process per rank); the outer
tests (tests/test_torch_ops.py) start them, so the outer pytest must not collect them itself.
"""

collect_ignore = ["mp"]
