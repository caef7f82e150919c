"""Optional dependencies: a feature that needs one says so before any work, in one line naming the extra to
install (``pip install 'fastagg[sim]'``), never with a traceback after a run."""
from __future__ import annotations

import importlib.util
import sys


_PACKAGES = {"sklearn": "scikit-learn", "dp_accounting": "dp-accounting"}  # import name -> the name pip installs


class MissingDependency(ImportError):
    """An optional package a feature needs is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingDependency` unless ``module`` can be imported (checked without importing it; a module
    set to None in ``sys.modules`` is blocked, as ``import`` treats it)."""
    top = module.split(".")[0]
    try:
        missing = sys.modules.get(top, False) is None or importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        missing = True
    if missing:
        raise MissingDependency(f"{feature} needs {_PACKAGES.get(top, top)}, which is not installed: "
                                f"pip install 'fastagg[{extra}]'")
