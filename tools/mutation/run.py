"""A small mutation-testing runner (stdlib only): ``make mutation``.

The curated mutants are data (``mutants.toml`` beside this file): for each, the file, an exact original snippet,
the mutated snippet, the tests that must catch it and a one-line description of the plausible bug it stands for.

The repository (``git ls-files`` plus the built extension modules ``fastagg/*.so``; not ``.venv``) is copied ONCE
into a temporary directory; every mutant is applied there, its tests run with that copy first on the path, and the
file restored. The checkout itself is never written, so a Ctrl-C cannot leave a mutant in it. A guard plugin
(written into the copy, passed with ``-p``) checks in every run that ``fastagg`` and the mutated module were
imported from the copy -- the editable install's finder must not win -- and fails the run with its own exit code
otherwise, so a wrong import can never pass as "caught".

Each distinct test selection first runs once on the unmutated copy (the baseline): a selection that fails without
a mutant cannot catch one. Results: ``caught`` (the tests failed), ``survived`` (they passed), ``error`` (snippet
not found or found more than once, the baseline failed, the guard fired, pytest could not run the selection, or a
timeout not declared as catching). A timeout counts as caught only for a mutant whose entry says
``timeout_caught = true`` (a mutant that makes a loop spin forever). The table and the score are printed; the exit
status is non-zero if any mutant survived or errored.

    .venv/bin/python tools/mutation/run.py                 # every mutant
    .venv/bin/python tools/mutation/run.py --only fedadam-tau-default,median-lower-upper
    .venv/bin/python tools/mutation/run.py --list
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_LIST = os.path.join(HERE, "mutants.toml")
GUARD_EXIT = 86  # the guard's exit status: the run imported code from outside the copy

# The guard plugin, written into the copy's root: pytest loads it with -p before any test module is imported.
GUARD = '''
import importlib, json, os, sys

import pytest

ROOT = os.path.realpath(os.environ["MUTATION_COPY"])
PACKAGE = os.environ["MUTATION_PACKAGE"]
MODULE = os.environ.get("MUTATION_MODULE") or None


def _under_root(path):
    return path is not None and os.path.realpath(path).startswith(ROOT + os.sep)


def pytest_sessionstart(session):
    mod = importlib.import_module(PACKAGE)
    where = getattr(mod, "__file__", None)
    if not _under_root(where):
        pytest.exit(f"mutation guard: {PACKAGE} was imported from {where}, not from the copy {ROOT}", GUARD_EXIT)


def pytest_sessionfinish(session, exitstatus):
    report = {"package": getattr(sys.modules.get(PACKAGE), "__file__", None), "module_imported": None}
    if MODULE:
        mod = sys.modules.get(MODULE)
        report["module_imported"] = getattr(mod, "__file__", None) if mod is not None else None
        if mod is not None and not _under_root(mod.__file__):
            session.exitstatus = GUARD_EXIT
            report["foreign"] = mod.__file__
    with open(os.environ["MUTATION_REPORT"], "w") as f:
        json.dump(report, f)
'''.replace("GUARD_EXIT", str(GUARD_EXIT))


@dataclasses.dataclass
class Mutant:
    id: str
    file: str
    original: str
    mutated: str
    tests: list
    description: str
    timeout_caught: bool = False


@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str  # caught / survived / error
    seconds: float
    detail: str = ""


def load(path: str) -> list:
    """The mutants of a TOML list (``[[mutant]]`` tables); a malformed entry raises naming it."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out, seen = [], set()
    for k, entry in enumerate(data.get("mutant", [])):
        name = entry.get("id", f"#{k}")
        missing = [key for key in ("id", "file", "original", "mutated", "tests", "description") if key not in entry]
        if missing:
            raise ValueError(f"mutant {name}: missing {', '.join(missing)}")
        unknown = set(entry) - {f.name for f in dataclasses.fields(Mutant)}
        if unknown:
            raise ValueError(f"mutant {name}: unknown keys {sorted(unknown)}")
        if name in seen:
            raise ValueError(f"mutant id {name!r} appears twice")
        if entry["original"] == entry["mutated"]:
            raise ValueError(f"mutant {name}: the mutated snippet equals the original")
        tests = entry["tests"]
        if isinstance(tests, str) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"mutant {name}: tests must be a non-empty list of pytest arguments")
        seen.add(name)
        out.append(Mutant(**entry))
    return out


def copy_repo(repo: str, dest: str, extra_globs=("fastagg/*.so",)) -> int:
    """Copy the files of ``repo`` that git tracks or would track (untracked files not ignored: new tests not yet
    committed), as they are in its work tree, plus ``extra_globs`` (the built modules), into ``dest``; returns the
    count. Tracked files deleted in the work tree are skipped; ignored ones (.venv, build outputs) never copied."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           check=True, capture_output=True).stdout.split(b"\0")
    files = [n.decode() for n in names if n]
    for pattern in extra_globs:
        files += [os.path.relpath(p, repo) for p in glob.glob(os.path.join(repo, pattern))]
    count = 0
    for rel in dict.fromkeys(files):
        src = os.path.join(repo, rel)
        if not os.path.isfile(src) or os.path.islink(src):
            continue
        dst = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
        count += 1
    return count


def apply(text: str, m: Mutant) -> str:
    """``text`` with ``m``'s original snippet replaced; raises LookupError unless it occurs exactly once."""
    n = text.count(m.original)
    if n != 1:
        raise LookupError(f"the original snippet occurs {n} times in {m.file} (must be exactly once)")
    return text.replace(m.original, m.mutated)


def module_name(path: str) -> str | None:
    if not path.endswith(".py"):
        return None
    parts = path[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _clear_pycache(copy: str, rel: str) -> None:
    cache = os.path.join(copy, os.path.dirname(rel), "__pycache__")
    stem = os.path.splitext(os.path.basename(rel))[0] + "."
    if os.path.isdir(cache):
        for name in os.listdir(cache):
            if name.startswith(stem):
                os.remove(os.path.join(cache, name))


def run_tests(copy: str, tests: list, *, python: str, package: str, module: str | None, timeout: float,
              pytest_args: list) -> tuple:
    """Run ``tests`` in ``copy``; returns (exit status or "timeout", seconds, output, guard report)."""
    report = os.path.join(copy, ".mutation-report.json")
    if os.path.exists(report):
        os.remove(report)
    env = dict(os.environ)
    env.update(PYTHONPATH=copy + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""),
               PYTHONDONTWRITEBYTECODE="1", TRITON_INTERPRET=env.get("TRITON_INTERPRET", "1"),
               MUTATION_COPY=copy, MUTATION_PACKAGE=package, MUTATION_MODULE=module or "", MUTATION_REPORT=report)
    cmd = [python, "-m", "pytest", "-p", "_mutation_guard", "-p", "no:cacheprovider", *pytest_args, *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc = "timeout"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    seconds = time.monotonic() - t0
    guard = None
    if os.path.exists(report):
        with open(report) as f:
            guard = json.load(f)
    return rc, seconds, out, guard


def first_failure(output: str) -> str:
    """The first failing test pytest's short summary names (``FAILED path::test``), else ''."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" - ")[0].split(" ", 1)[1]
    return ""


def classify(m: Mutant, rc, output: str, guard) -> tuple:
    if rc == GUARD_EXIT:
        return "error", "guard: " + (guard or {}).get("foreign", output.strip().splitlines()[-1] if output else "")
    if rc == "timeout":
        return ("caught", "timeout (declared as catching)") if m.timeout_caught else ("error", "timeout")
    if rc == 0:
        return "survived", ""
    if rc == 1:  # tests failed
        return "caught", first_failure(output) or "tests failed"
    return "error", f"pytest exit status {rc}: " + " | ".join(output.strip().splitlines()[-3:])


def run(mutants: list, *, repo: str, python: str, package: str = "fastagg", timeout: float = 300.0,
        pytest_args: list | None = None, baseline: bool = True, keep: bool = False, log=print,
        extra_globs=("fastagg/*.so",)) -> list:
    pytest_args = ["-q", "-x", "-n", "0"] if pytest_args is None else pytest_args
    copy = os.path.realpath(tempfile.mkdtemp(prefix="fastagg-mutation-"))
    results = []
    try:
        n = copy_repo(repo, copy, extra_globs)
        with open(os.path.join(copy, "_mutation_guard.py"), "w") as f:
            f.write(GUARD)
        log(f"copied {n} files of {repo} to {copy}")
        base_ok: dict = {}
        for m in mutants:
            path = os.path.join(copy, m.file)
            key = tuple(m.tests)
            try:
                with open(path) as f:
                    original_text = f.read()
                mutated_text = apply(original_text, m)
            except (OSError, LookupError) as e:
                results.append(Result(m, "error", 0.0, str(e)))
                log(f"{m.id:34s} error     {e}")
                continue
            if baseline and key not in base_ok:
                rc, secs, out, guard = run_tests(copy, m.tests, python=python, package=package, module=None,
                                                 timeout=timeout, pytest_args=pytest_args)
                base_ok[key] = (rc == 0, f"baseline of {' '.join(m.tests)}: exit {rc} ({secs:.0f} s) "
                                + first_failure(out))
                log(f"{'(baseline)':34s} {'ok' if rc == 0 else 'FAILED':9s} {secs:5.1f} s  {' '.join(m.tests)}")
                if rc != 0:
                    log(out[-3000:])
            if baseline and not base_ok[key][0]:
                results.append(Result(m, "error", 0.0, base_ok[key][1]))
                log(f"{m.id:34s} error     {base_ok[key][1]}")
                continue
            try:
                with open(path, "w") as f:
                    f.write(mutated_text)
                _clear_pycache(copy, m.file)
                rc, secs, out, guard = run_tests(copy, m.tests, python=python, package=package,
                                                 module=module_name(m.file), timeout=timeout, pytest_args=pytest_args)
            finally:
                with open(path, "w") as f:
                    f.write(original_text)
                _clear_pycache(copy, m.file)
            status, detail = classify(m, rc, out, guard)
            if status != "error" and guard is not None and m.file.endswith(".py") and guard.get("module_imported") is None:
                status, detail = "error", f"the tests never imported {module_name(m.file)} ({status} otherwise)"
            results.append(Result(m, status, secs, detail))
            log(f"{m.id:34s} {status:9s} {secs:5.1f} s  {detail}")
    finally:
        if keep:
            log(f"kept {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)
    return results


def table(results: list) -> str:
    caught = sum(r.status == "caught" for r in results)
    lines = ["| mutant | file | plausible bug | result | caught by | s |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.mutant.id} | {r.mutant.file} | {r.mutant.description} | {r.status} | "
                     f"{r.detail.replace('|', '/')} | {r.seconds:.0f} |")
    lines.append("")
    lines.append(f"score: {caught}/{len(results)} caught"
                 f" ({sum(r.status == 'survived' for r in results)} survived,"
                 f" {sum(r.status == 'error' for r in results)} errors)")
    return "\n".join(lines)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    # SIGTERM (and SIGINT, which a shell's background job ignores) stop the run cleanly: the running pytest's
    # process group is killed and the temporary copy removed
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list-file", default=DEFAULT_LIST, help="the TOML list of mutants (default: mutants.toml)")
    ap.add_argument("--repo", default=os.path.dirname(os.path.dirname(HERE)), help="the repository to copy")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs pytest")
    ap.add_argument("--only", default="", help="comma-separated mutant ids")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per test run (default 300)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of each test selection")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--json", help="write the results here as JSON")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    mutants = load(args.list_file)
    if args.only:
        wanted = [s for s in args.only.split(",") if s]
        unknown = set(wanted) - {m.id for m in mutants}
        if unknown:
            ap.error(f"unknown mutant ids: {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m.id in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.id:34s} {m.file:32s} {m.description}")
        return 0
    t0 = time.monotonic()
    results = run(mutants, repo=os.path.abspath(args.repo), python=args.python, timeout=args.timeout,
                  baseline=not args.no_baseline, keep=args.keep,
                  log=lambda *a: print(*a, flush=True))
    print()
    print(table(results))
    print(f"total {time.monotonic() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"id": r.mutant.id, "file": r.mutant.file, "description": r.mutant.description,
                        "status": r.status, "detail": r.detail, "seconds": round(r.seconds, 1)} for r in results],
                      f, indent=1)
    return 0 if results and all(r.status == "caught" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
