"""The mutation runner of ``make mutation`` (tools/mutation/run.py), on a tiny repository of its own: a mutant the
tests catch, one they miss, a snippet not found or found twice, a timeout, a guard that sees code imported from
outside the copy -- and the checkout it copied never written. One case runs against fastagg itself: the copy, not
the editable install, is what its tests import."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("mutation_run", os.path.join(ROOT, "tools", "mutation", "run.py"))
mr = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutation_run", mr)  # (dataclasses look their module up there)
_spec.loader.exec_module(mr)

MOD = "def add(a, b):\n    return a + b\n\n\nUNUSED = 1\n"
TEST = "from pkg.mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


@pytest.fixture(autouse=True)
def _lean_pytest(monkeypatch):
    """The tiny repository's runs load no installed plugins (hypothesis, benchmark, Flower's...): each is one
    short pytest process."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")


def _repo(tmp_path, conftest: str | None = None) -> str:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pkg" / "__init__.py").write_text("")
    (repo / "pkg" / "mod.py").write_text(MOD)
    (repo / "tests" / "test_mod.py").write_text(TEST)
    (repo / ".gitignore").write_text("ignored/\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.txt").write_text("x")
    if conftest is not None:
        (repo / "conftest.py").write_text(conftest)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return str(repo)


def _mutant(id, original, mutated, **kw):
    return mr.Mutant(id=id, file=kw.pop("file", "pkg/mod.py"), original=original, mutated=mutated,
                     tests=kw.pop("tests", ["tests/test_mod.py"]), description=id, **kw)


def _run(repo, mutants, **kw):
    kw.setdefault("pytest_args", ["-q", "-x"])
    return mr.run(mutants, repo=repo, python=sys.executable, package="pkg", extra_globs=(), log=lambda *a: None,
                  **kw)


def test_caught_survived_and_missing_snippets_are_told_apart_and_the_checkout_is_never_written(tmp_path):
    repo = _repo(tmp_path)
    before = {p: open(os.path.join(repo, p)).read() for p in ("pkg/mod.py", "tests/test_mod.py")}
    res = _run(repo, [
        _mutant("sign", "return a + b", "return a - b"),
        _mutant("unused", "UNUSED = 1", "UNUSED = 2"),
        _mutant("gone", "return a * b", "return a"),
        _mutant("twice", "a", "z"),
        _mutant("nofile", "x", "y", file="pkg/nope.py"),
    ])
    got = {r.mutant.id: (r.status, r.detail) for r in res}
    assert got["sign"][0] == "caught" and "tests/test_mod.py::test_add" in got["sign"][1], got["sign"]
    assert got["unused"] == ("survived", ""), got["unused"]
    assert got["gone"][0] == "error" and "occurs 0 times" in got["gone"][1], got["gone"]
    assert got["twice"][0] == "error" and "times" in got["twice"][1] and "0 times" not in got["twice"][1]
    assert got["nofile"][0] == "error"
    assert {p: open(os.path.join(repo, p)).read() for p in before} == before
    assert not any(n.startswith(".mutation") or n == "_mutation_guard.py" for n in os.listdir(repo))
    table = mr.table(res)
    assert "score: 1/5 caught (1 survived, 3 errors)" in table


def test_each_mutant_sees_the_original_of_the_ones_before(tmp_path):
    """The copy is restored after every mutant: a second mutant of the same line finds the original snippet."""
    repo = _repo(tmp_path)
    res = _run(repo, [_mutant("a", "return a + b", "return a - b"), _mutant("b", "return a + b", "return b")])
    assert [r.status for r in res] == ["caught", "caught"]


def test_a_failing_baseline_is_an_error_not_a_catch(tmp_path):
    repo = _repo(tmp_path)
    with open(os.path.join(repo, "tests", "test_mod.py"), "a") as f:
        f.write("\n\ndef test_broken():\n    assert False\n")
    res = _run(repo, [_mutant("sign", "return a + b", "return a - b")])
    assert res[0].status == "error" and "baseline" in res[0].detail


def test_a_timeout_is_caught_only_where_the_mutant_says_so(tmp_path):
    repo = _repo(tmp_path)
    spin = "while True:\n        pass"
    res = _run(repo, [_mutant("spin", "return a + b", spin), _mutant("spin2", "return a + b", spin,
                                                                      timeout_caught=True)],
               timeout=1.5, baseline=False)
    assert [(r.status, r.detail) for r in res] == [("error", "timeout"), ("caught", "timeout (declared as catching)")]


def test_the_guard_refuses_a_run_that_imports_the_package_from_outside_the_copy(tmp_path):
    """Here a conftest puts another ``pkg`` first on the path (as an editable install's finder could): the run is
    an error, never a catch, though the tests fail."""
    other = tmp_path / "elsewhere" / "pkg"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "mod.py").write_text("def add(a, b):\n    return -1\n")
    repo = _repo(tmp_path, conftest=textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(other.parent)!r})
    """))
    res = _run(repo, [_mutant("sign", "return a + b", "return a - b")], baseline=False)
    assert res[0].status == "error" and res[0].detail.startswith("guard"), res[0]


def test_a_mutant_of_a_module_the_tests_never_import_is_an_error(tmp_path):
    repo = _repo(tmp_path)
    (tmp_path / "repo" / "pkg" / "other.py").write_text("X = 1\n")
    res = _run(repo, [_mutant("other", "X = 1", "X = 2", file="pkg/other.py")])
    assert res[0].status == "error" and "never imported pkg.other" in res[0].detail


def test_copy_takes_untracked_files_and_leaves_ignored_ones(tmp_path):
    repo = _repo(tmp_path)
    dest = tmp_path / "copy"
    dest.mkdir()
    mr.copy_repo(repo, str(dest), extra_globs=())
    assert (dest / "pkg" / "mod.py").read_text() == MOD
    assert not (dest / "ignored").exists()


def test_the_list_is_data_and_malformed_entries_are_named(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[[mutant]]\nid = 'x'\nfile = 'f.py'\noriginal = 'a'\nmutated = 'a'\ntests = ['t']\n"
                    "description = 'd'\n")
    with pytest.raises(ValueError, match="mutant x: the mutated snippet equals the original"):
        mr.load(str(path))
    path.write_text("[[mutant]]\nid = 'x'\nfile = 'f.py'\noriginal = 'a'\nmutated = 'b'\ntests = 't'\n"
                    "description = 'd'\n")
    with pytest.raises(ValueError, match="mutant x: tests must be a non-empty list"):
        mr.load(str(path))
    path.write_text("[[mutant]]\nid = 'x'\nfile = 'f.py'\noriginal = 'a'\n")
    with pytest.raises(ValueError, match="mutant x: missing mutated, tests, description"):
        mr.load(str(path))


def test_the_curated_list_covers_every_area_with_at_least_40_mutants():
    mutants = mr.load(mr.DEFAULT_LIST)
    assert len(mutants) >= 40
    files = {m.file for m in mutants}
    for area in ("fastagg/server/", "fastagg/fedexp_rule.py", "fastagg/result.py", "fastagg/privacy/",
                 "fastagg/robust.py", "fastagg/compress/", "fastagg/asynchronous.py", "fastagg/stream/"):
        assert any(f.startswith(area) for f in files), area
    ids = {m.id for m in mutants}
    for named in ("fedadam-tau-default", "median-lower-takes-upper", "accountant-poisson-rate",
                  "qsgd-levels-clamped-below-s"):  # the four survivors of the run
        assert named in ids, named


def test_in_a_copy_of_fastagg_the_copy_is_imported_not_the_editable_install(tmp_path, monkeypatch):
    """The editable install's finder must not win over the copy: a probe test imports fastagg.fedexp_rule there, and
    the guard reports where it came from."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD")  # fastagg's pytest settings name installed plugins
    copy = str(tmp_path / "copy")
    os.makedirs(copy)
    mr.copy_repo(ROOT, copy)
    with open(os.path.join(copy, "_mutation_guard.py"), "w") as f:
        f.write(mr.GUARD)
    with open(os.path.join(copy, "tests", "test_probe_import.py"), "w") as f:
        f.write("def test_probe():\n    import fastagg.fedexp_rule\n")
    rc, _, out, guard = mr.run_tests(copy, ["tests/test_probe_import.py"], python=sys.executable, package="fastagg",
                                     module="fastagg.fedexp_rule", timeout=120, pytest_args=["-q", "-n", "0"])
    assert rc == 0, out
    real = os.path.realpath(copy)
    assert guard["package"].startswith(real + os.sep) and guard["module_imported"].startswith(real + os.sep), guard
