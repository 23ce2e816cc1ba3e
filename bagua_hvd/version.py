"""The package's version, in a module that imports nothing: the launcher (``bagua-run
--version``, ``--check-build``) depends on it, not on the package's ``__init__``, which depends on
the launcher (``bagua_hvd.run``)."""

__version__ = "0.1.0"
