"""``import horovod`` as bagua_hvd: the zero-line migration (``BAGUA_HVD_AS_HOROVOD=1``).

The start-up hook the package installs (``bagua_hvd_as_horovod.pth`` in site-packages) runs in
every Python process; it only tests whether the variable is in the environment, and imports
nothing when it is not. When it is, it calls :func:`install_if_asked`: with the variable on
(``config.as_horovod``), a ``sys.meta_path`` finder, ahead of every other, then answers for
``horovod`` and all of its submodules, so a real Horovod installed beside is never loaded.

- ``horovod.X.Y`` is ``bagua_hvd.X.Y`` itself (the same module object in ``sys.modules`` under
  both names: ``horovod.torch is bagua_hvd.torch``). bagua_hvd keeps Horovod's module layout
  (``torch``, ``tensorflow``, ``tensorflow.keras``, ``keras``, ``_keras``, ``common``, ``data``,
  ``runner``, ``ray``, ``spark``, ...), so the name is the only thing that changes.
- A Horovod module bagua_hvd does not have (``horovod.spark.lightning``, ``horovod.mxnet``, ...)
  raises ``ModuleNotFoundError`` naming it and saying why, at once (no real Horovod module is
  mixed in).
- ``horovod`` itself is a small package of its own: ``horovod.run`` is ``bagua_hvd.run`` and
  ``horovod.__version__`` is ``"0.28.1+bagua_hvd.<version>"``: the Horovod release whose API
  bagua_hvd provides (so scripts comparing versions take their 0.28 paths), and a local label
  that says it is bagua_hvd.
- When a real Horovod is installed too, the first ``import horovod`` of the job (rank 0, or a
  process outside a job) writes one line to stderr saying that bagua_hvd answers instead.

Kept light: this module imports only the standard library's import machinery and
``bagua_hvd.common.config`` (where the variable is named); nothing of it runs when the variable
is unset.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Optional, Sequence

from bagua_hvd.common import config
from bagua_hvd.version import __version__

#: The Horovod release whose names, defaults and behaviour bagua_hvd keeps.
HOROVOD_API_VERSION = "0.28.1"
#: ``horovod.__version__`` under the alias (PEP 440: a local version label naming bagua_hvd).
VERSION = f"{HOROVOD_API_VERSION}+bagua_hvd.{__version__}"

_ALIAS = "horovod"
_TARGET = "bagua_hvd"


def target_name(fullname: str) -> Optional[str]:
    """The bagua_hvd module that answers for ``fullname`` (``horovod.torch`` ->
    ``bagua_hvd.torch``); None for a name outside ``horovod`` and for ``horovod`` itself, which
    is a module of its own (:class:`_TopLoader`)."""
    if not fullname.startswith(_ALIAS + "."):
        return None
    return _TARGET + fullname[len(_ALIAS) :]


class _AliasLoader:
    """Loads ``horovod.X`` as the module ``bagua_hvd.X`` (imported by name, once)."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        # The import system gives the module the alias's spec next; keep its own to restore.
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed as bagua_hvd.X: only undo the spec that the import system replaced,
        # so that the module stays bagua_hvd.X to reload, pickle and multiprocessing.
        module.__spec__ = self._own_spec

    def get_code(self, fullname: str) -> Any:
        """``python -m horovod.runner.launch``: runpy runs bagua_hvd's module's code."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target) if spec and spec.loader else None


class _TopLoader:
    """Builds the package ``horovod``: ``__version__``, ``run``, and the note about a real
    Horovod installed beside."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = (
            f"bagua_hvd {__version__} answering for Horovod ({config.AS_HOROVOD_ENV}=1; see "
            "bagua_hvd.as_horovod). horovod.X is bagua_hvd.X."
        )
        module.__version__ = VERSION
        module.__getattr__ = _top_getattr
        _note_real_horovod()

    def get_code(self, fullname: str) -> None:
        return None


def _top_getattr(name: str) -> Any:
    """``horovod.run`` (loaded on first use, as ``bagua_hvd.run``)."""
    if name == "run":
        import bagua_hvd

        return bagua_hvd.run
    raise AttributeError(f"module {_ALIAS!r} has no attribute {name!r}")


class HorovodAliasFinder:
    """The ``sys.meta_path`` finder of :func:`install`: ``horovod`` and ``horovod.*``."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]] = None, target: Any = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == _ALIAS:
            spec = importlib.machinery.ModuleSpec(
                _ALIAS, _TopLoader(), origin=__file__, is_package=True
            )
            spec.has_location = True  # horovod.__file__: this file, which says what it is
            return spec
        name = target_name(fullname)
        if name is None:
            return None
        # The parent (horovod.X for horovod.X.Y) is imported already: so is bagua_hvd.X, and
        # find_spec only looks for the last part.
        found = importlib.util.find_spec(name)
        if found is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: {config.AS_HOROVOD_ENV}=1 makes 'horovod' bagua_hvd "
                f"{__version__}, which has no {name} (bagua_hvd provides horovod.torch, "
                "horovod.tensorflow, horovod.tensorflow.keras, horovod.keras, horovod.runner, "
                f"horovod.ray, horovod.spark, ...). Unset {config.AS_HOROVOD_ENV} to import a real "
                "Horovod.",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(name),
            origin=found.origin,
            is_package=found.submodule_search_locations is not None,
        )


def installed() -> bool:
    """Whether ``horovod`` resolves to bagua_hvd in this process."""
    return any(isinstance(f, HorovodAliasFinder) for f in sys.meta_path)


def install() -> None:
    """Makes ``import horovod`` (and every ``horovod.X``) bagua_hvd in this process, ahead of
    any Horovod installed. Idempotent. The start-up hook calls it (:func:`install_if_asked`)
    when ``BAGUA_HVD_AS_HOROVOD`` is on; call it directly to switch a process over without the
    variable (before anything imported a real ``horovod``: RuntimeError otherwise)."""
    if installed():
        return
    real = sys.modules.get(_ALIAS)
    if real is not None:
        raise RuntimeError(
            f"bagua_hvd.as_horovod.install(): a Horovod module is imported already "
            f"({getattr(real, '__file__', real)!r}); install before importing horovod"
        )
    sys.meta_path.insert(0, HorovodAliasFinder())


def install_if_asked() -> None:
    """The start-up hook's call, when ``BAGUA_HVD_AS_HOROVOD`` is in the environment:
    :func:`install` when it is on (``0``, ``false``, ``no``, ``off`` and empty are off)."""
    if config.as_horovod():
        install()


def uninstall() -> None:
    """Undoes :func:`install`: ``horovod`` and its submodules are forgotten under that name
    (the bagua_hvd modules stay imported as bagua_hvd.X)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, HorovodAliasFinder)]
    for name in [n for n in sys.modules if n == _ALIAS or n.startswith(_ALIAS + ".")]:
        del sys.modules[name]


def _note_real_horovod() -> None:
    """One line to stderr when a real Horovod is on sys.path too: the variable wins. Written by
    the job's rank 0 (or a process outside a job) only, once per process."""
    real = importlib.machinery.PathFinder.find_spec(_ALIAS)
    if real is None:
        return
    rank = config.launcher_rank()
    if rank not in (None, 0):
        return
    where = (real.submodule_search_locations or [real.origin])[0]
    print(
        f"bagua_hvd: {config.AS_HOROVOD_ENV} is set: 'import horovod' is bagua_hvd "
        f"{__version__}, not the Horovod installed at {where} (unset {config.AS_HOROVOD_ENV} to "
        "use that one)",
        file=sys.stderr,
        flush=True,
    )
