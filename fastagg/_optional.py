"""Optional dependencies: a feature that needs one says so before any work, in one line naming the packages to
install, never with a traceback after a run.

fastagg is not published on a package index yet, so the hint never says ``pip install 'fastagg[sim]'`` (that would
install nothing, or somebody else's package if the name were taken): it names the extra's own requirements, read
from the installed package's metadata (so they are the pins of the build in use), and the form that works from a
checkout (``pip install '.[sim]'``)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import shlex
import sys


_PACKAGES = {"sklearn": "scikit-learn", "dp_accounting": "dp-accounting"}  # import name -> the name pip installs


class MissingDependency(ImportError):
    """An optional package a feature needs is not installed; the message says what to install."""


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of fastagg's optional-dependency group ``extra`` (e.g. ``["flwr<2,>=1.42"]`` for
    ``"flower"``), from the installed distribution's metadata; ``[]`` when fastagg runs from a tree that was never
    installed."""
    try:
        requires = importlib.metadata.requires("fastagg") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    out = []
    for line in requires:
        spec, _, marker = line.partition(";")
        # pip writes the marker as `extra == "flower"`; other tools may use single quotes or no spaces
        if marker.replace(" ", "").replace("'", '"') in (f'extra=="{extra}"',):
            out.append(spec.strip())
    return out


def install_hint(extra: str) -> str:
    """The command that installs what fastagg's ``[extra]`` brings: ``pip install 'flwr<2,>=1.42' (fastagg's
    [flower] extra; from a fastagg checkout: pip install '.[flower]')``."""
    checkout = f"pip install '.[{extra}]'"
    reqs = extra_requirements(extra)
    if not reqs:
        return f"{checkout} (from a fastagg checkout)"
    return f"pip install {' '.join(shlex.quote(r) for r in reqs)} (fastagg's [{extra}] extra; from a fastagg " \
           f"checkout: {checkout})"


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
                                f"{install_hint(extra)}")
