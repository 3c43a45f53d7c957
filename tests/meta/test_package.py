"""decodekit.meta's lazy exports (meta/__init__.py)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import decodekit.meta as meta


def test_exported_names_stay_what_they_name_after_their_modules_are_imported():
    # Importing a submodule makes it an attribute of the package, which the lazy
    # `__getattr__` (asked only for missing attributes) can no longer shadow: an export
    # named like its module turned into the module once anything imported it.
    for module in sorted(set(meta._EXPORTS.values())):
        importlib.import_module(f"decodekit.meta.{module}")
    from decodekit.meta import mbr, refine

    assert inspect.isfunction(refine) and refine.__module__ == "decodekit.meta.refinement"
    assert inspect.isfunction(mbr) and mbr.__module__ == "decodekit.meta.bayes_risk"
    for name in meta.__all__:
        assert not inspect.ismodule(getattr(meta, name)), name
    submodules = {info.name for info in pkgutil.iter_modules(meta.__path__)}
    assert not submodules & set(meta.__all__)
