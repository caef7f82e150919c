"""The suite leaves nothing behind: a pytest session that starts torchrun (its torchelastic_* log folder), emits
Flower telemetry (Flower writes ~/.flwr/source unless FLWR_HOME says otherwise) and draws a matplotlib figure (its
font cache in ~/.cache/matplotlib) -- what the distributed, Flower and simulator tests do -- leaves the home
directory as it was and the temp directory as it was but for pytest's own pytest-of-<user>/ folder."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CASE = '''
import subprocess, sys

def test_torchrun_one_process():
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        "-m", "platform"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr

def test_flower_telemetry_source_id():
    from flwr.supercore.telemetry import _get_source_id
    assert _get_source_id() != "unavailable"

def test_matplotlib_figure(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig = plt.figure(); fig.savefig(tmp_path / "f.png"); plt.close(fig)
'''


def _tree(p: Path) -> set[str]:
    return {str(q.relative_to(p)) for q in p.rglob("*")}


def test_a_session_with_torchrun_and_flower_leaves_home_and_temp_as_they_were(tmp_path):
    home, tmp, case = tmp_path / "home", tmp_path / "tmp", tmp_path / "case"
    for d in (home, tmp, case):
        d.mkdir()
    (case / "test_case.py").write_text(CASE)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLWR_", "PYTEST_", "TORCHELASTIC_", "FASTAGG_TEST_SCRATCH", "MPLCONFIGDIR"))}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                        "-o", "addopts=", "--rootdir", str(case), str(case / "test_case.py")],
                       cwd=case, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 passed" in r.stdout, r.stdout[-2000:]
    left_home = _tree(home)
    assert not left_home, f"left in HOME: {sorted(left_home)}"
    left_tmp = {p for p in os.listdir(tmp) if not p.startswith("pytest-of-")}
    assert not left_tmp, f"left in the temp directory: {sorted(left_tmp)}"
