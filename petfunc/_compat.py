"""The module paths of petfunc's flat layout, importable for one more release.

petfunc's modules live in layered subpackages (``petfunc.graph.neighbors``, not
``petfunc.neighbors``). Code written against the flat layout keeps working: an
import of an old path gets the module at its new path, with a
``DeprecationWarning`` that names it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


#: old module path -> the module it is now
MOVED = {
    "petfunc.adaptive": "petfunc.model.adaptive",
    "petfunc.ase_batch": "petfunc.ase.batch",
    "petfunc.batching": "petfunc.data.batching",
    "petfunc.bmm": "petfunc.ops.bmm",
    "petfunc.cutoff": "petfunc.model.cutoff",
    "petfunc.datafiles": "petfunc.data.read",
    "petfunc.fused_attention": "petfunc.ops.fused_attention",
    "petfunc.long_range": "petfunc.model.long_range",
    "petfunc.lookup": "petfunc.ops.lookup",
    "petfunc.loss": "petfunc.train.loss",
    "petfunc.neighbors": "petfunc.graph.neighbors",
    "petfunc.nn": "petfunc.model.nn",
    "petfunc.options": "petfunc.trainer.options",
    "petfunc.permute": "petfunc.ops.permute",
    "petfunc.transformer": "petfunc.model.transformer",
    "petfunc.zbl": "petfunc.model.zbl",
}

#: old module path -> the module it is now, without a warning: the new module is
#: also the package's attribute of the old name (``petfunc.hessian_loss``)
ALIASES = {
    "petfunc.hessian_loss": "petfunc.train.hessian_loss",
}


def _moved(old: str):
    new = MOVED[old]
    warnings.warn(
        f"{old} is now {new}; the old path goes in a later release", DeprecationWarning, stacklevel=3
    )
    return importlib.import_module(new)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of :data:`MOVED` and :data:`ALIASES`; loading one returns
    the new module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED or fullname in ALIASES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        if spec.name in ALIASES:
            return importlib.import_module(ALIASES[spec.name])
        return _moved(spec.name)

    def exec_module(self, module):
        pass  # the module at the new path is already executed


def install() -> None:
    """Make the old paths importable (idempotent)."""
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())


def module_getattr(name: str):
    """``petfunc.<old name>`` as an attribute (the package's ``__getattr__``)."""
    if f"petfunc.{name}" in MOVED:
        return _moved(f"petfunc.{name}")
    raise AttributeError(f"module 'petfunc' has no attribute {name!r}")
