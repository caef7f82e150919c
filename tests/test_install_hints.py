"""What a missing optional dependency tells the user to run must install it: fastagg is not published on a package
index, so ``pip install 'fastagg[flower]'`` would install nothing of ours (or somebody else's package). The hint
names the extra's own requirements -- compared here with pyproject.toml, read independently of the code -- and the
checkout form ``pip install '.[flower]'``."""
import shlex
import tomllib
from pathlib import Path

import pytest

from fastagg import _optional

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def _norm(req: str) -> tuple[str, frozenset[str]]:
    """'flwr>=1.42,<2' and 'flwr<2,>=1.42' name the same requirement: name + the set of its specifiers."""
    for i, ch in enumerate(req):
        if ch in "<>=!~[ ":
            return req[:i].lower(), frozenset(s.strip() for s in req[i:].split(",") if s.strip())
    return req.lower(), frozenset()


@pytest.mark.parametrize("extra", ["flower", "sim", "dp", "nvflare", "gpu"])
def test_the_hint_installs_exactly_the_extras_requirements_and_never_names_an_unpublished_package(extra):
    hint = _optional.install_hint(extra)
    assert "fastagg[" not in hint, hint
    assert f"pip install '.[{extra}]'" in hint, hint
    # the installed metadata is this checkout's (make test reinstalls when pyproject.toml changes)
    command = hint.split(" (fastagg's")[0]
    words = shlex.split(command)
    assert words[:2] == ["pip", "install"], hint
    assert {_norm(w) for w in words[2:]} == {_norm(r) for r in EXTRAS[extra]}, hint


def test_require_names_the_missing_package_and_the_working_command(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "sklearn", None)  # as if it were not installed
    with pytest.raises(_optional.MissingDependency) as e:
        _optional.require("sklearn", "sim", "the digits data set")
    msg = str(e.value)
    assert msg.startswith("the digits data set needs scikit-learn, which is not installed: pip install "), msg
    assert "'.[sim]'" in msg and "fastagg[" not in msg, msg
