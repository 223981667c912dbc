"""Integrations with other libraries, registered lazily so ``import cp_attention`` stays cheap.

The engine never imports this package: what it needs from an integration (how ``cp.shard_batch``
reads a collator's batch) is registered into :mod:`cp_attention.engine.context` by :func:`install`."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from ..engine.context import register_batch_convention
from .hf import state
from .patches import record

__all__ = ["install"]

_TRIGGER = "transformers.modeling_utils"


def _register_transformers() -> None:
    try:
        from .hf.registry import register

        register()
    except ImportError as exc:  # an unsupported transformers version: say so, do not break transformers
        warnings.warn(f"cp_attention: attn_implementation='cp_flash' is not available: {exc}", stacklevel=2)


class _LoaderThenRegister(importlib.abc.Loader):
    """Runs the real loader, then registers "cp_flash"; everything else is the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_transformers()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _LoaderThenAdapt(_LoaderThenRegister):
    """Runs the real loader of a transformers modeling module, then adapts it for "cp_flash"."""

    def exec_module(self, module):
        self._loader.exec_module(module)
        from .hf.registry import NAME, adapt_modeling_module

        if NAME in state.INTEGRATIONS["registered"]:
            adapt_modeling_module(module)


class _ModelingImports(importlib.abc.MetaPathFinder):
    """Import hook that stays: each ``transformers.models.*.modeling_*`` (and ``configuration_*``) module is
    adapted for "cp_flash" as it loads (its by-name flash checks and class tables, see
    :func:`.transformers.adapt_modeling_module`), before any model of it is built."""

    def find_spec(self, fullname, path, target=None):
        if not (fullname.startswith("transformers.models.") and (".modeling_" in fullname or
                                                                  ".configuration_" in fullname)):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThenAdapt(spec.loader)
                return spec
        return None


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: registers "cp_flash" right after transformers' modeling code loads."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenRegister(spec.loader)
        return spec


def install() -> None:
    """Register transformers' batch conventions for ``cp.shard_batch`` (plain torch, no transformers
    import) and "cp_flash" now if transformers' modeling code is loaded, else when it loads."""
    from .hf.batch import shard_batch

    register_batch_convention("transformers", shard_batch)
    if not any(isinstance(f, _ModelingImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _ModelingImports())
        record("import_hooks", "sys.meta_path: the modeling-module finder", sys.meta_path[0],
               admitted="the module's name")
    if _TRIGGER in sys.modules:
        _register_transformers()
    elif importlib.util.find_spec("transformers") is not None and not any(
            isinstance(f, _AfterTransformersImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformersImport())
        record("import_hooks", "sys.meta_path: the one-shot registration finder", sys.meta_path[0],
               admitted="transformers importable, its modeling code not loaded yet")
