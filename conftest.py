import atexit
import os
import shutil
import tempfile

import torch

# What the suite's processes leave behind -- Flower's telemetry (it writes ~/.flwr/source unless FLWR_HOME says
# otherwise), matplotlib's font cache and config (~/.cache/matplotlib, ~/.config/matplotlib unless MPLCONFIGDIR),
# Ray's session folders, torchrun's torchelastic_* log folders, uv's locks from Flower's runtime installs -- goes into
# one scratch folder per pytest process, removed when that process ends: the suite writes nothing to the user's home
# and leaves nothing in the temp directory but pytest's own pytest-of-<user>/ (its tmp_path folders, the last three
# runs kept for debugging, as pytest always does: tempfile caches the temp directory before TMPDIR changes, so only
# child processes and libraries that read TMPDIR themselves, as Ray does, see the scratch folder).
# pytest-xdist's workers share their controller's folder (FASTAGG_TEST_SCRATCH, inherited): a folder nested per
# worker made Ray's socket paths (.../ray/session_<date>_<pid>/sockets/plasma_store) longer than the 107 bytes
# AF_UNIX allows. The short prefix keeps them well inside it.
_TEMP = tempfile.gettempdir()
SCRATCH = os.environ.get("FASTAGG_TEST_SCRATCH", "")
if not (SCRATCH and os.path.isdir(SCRATCH)):
    SCRATCH = tempfile.mkdtemp(prefix="fa-", dir=_TEMP)
    os.environ["FASTAGG_TEST_SCRATCH"] = SCRATCH
    atexit.register(shutil.rmtree, SCRATCH, ignore_errors=True)  # by the process that made it, when it ends
os.environ["TMPDIR"] = SCRATCH
os.environ["FLWR_HOME"] = os.path.join(SCRATCH, "flwr")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["MPLCONFIGDIR"] = os.path.join(SCRATCH, "matplotlib")

# The Triton interpreter must be chosen before any @triton.jit function is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_sessionfinish(session, exitstatus):
    """A run where nothing passed (all skipped or deselected) is a failure: CI must never go green on nothing."""
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller counts every worker's tests
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and exitstatus == 0 and not reporter.stats.get("passed"):
        session.exitstatus = 1


@pytest.fixture
def full() -> bool:
    """FASTAGG_FULL=1 runs heavy cases at full size (CI runs them reduced)."""
    return os.environ.get("FASTAGG_FULL", "0") == "1"
