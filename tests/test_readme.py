"""Every code block of the README runs, extracted from the README itself, so the README cannot drift from the code.

Python blocks run as a reader would paste them (in a fresh namespace, in a scratch directory); a block that needs
what only a framework gives (Flower's ``grid``, a torch.distributed launch, a GPU, NVIDIA FLARE) runs inside it:
the Flower ServerApp's ``main`` is called with a Grid whose nodes train, the torch.distributed block runs as two
gloo processes on 127.0.0.1, the CUDA block runs where CUDA is (tests/test_on_device.py's machine; here it is
compiled), the FLARE block runs in FLARE's own environment (tests_nvflare/test_readme_block.py). Shell blocks run
command by command with this interpreter, the simulator's rounds cut to 2 (``--rounds`` given last wins) and the
reproduction to ``--quick`` on one claim; the TOML block is the ``runs.toml`` its command reads. The layout block's
every path exists."""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = [(m.group(1), m.group(2), README[:m.start()].count("\n") + 1)
          for m in re.finditer(r"^```(\w*)\n(.*?)^```$", README, re.S | re.M)]
# shell commands the test does not run, and why (each is run elsewhere)
NOT_RUN = {"make test": "it is this suite",
           "python -m venv": "CI's make test-package (.ci/package.sh) installs the package into a fresh venv",
           "pip install": "CI's make test-package (.ci/package.sh) installs the package into a fresh venv"}


def _kind(code: str) -> str:
    if "fastagg.nvflare" in code:  # first: its comment names device="cuda" (the card has no nvflare to run it)
        return "nvflare"
    if "device=\"cuda\"" in code or "torch.cuda.graph" in code:
        return "cuda"
    if "from fastagg import flower" in code:
        return "flower"
    if "init_process_group" in code:
        return "distributed"
    return "plain"


def _python(kind):
    return [pytest.param(code, id=f"line{line}") for lang, code, line in BLOCKS if lang == "python" and _kind(code) == kind]


def test_every_block_is_of_a_kind_this_test_runs():
    assert {lang for lang, _, _ in BLOCKS} <= {"python", "bash", "toml", "text"}, [b[0] for b in BLOCKS]
    assert sum(lang == "python" for lang, _, _ in BLOCKS) >= 8


@pytest.mark.parametrize("code", _python("plain"))
def test_python_block_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write files (round.pt) where they run
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_block"})


@pytest.mark.parametrize("code", _python("cuda") + _python("nvflare"))
def test_blocks_run_elsewhere_compile_here(code):
    compile(code, "README.md", "exec")
    if _kind(code) == "cuda" and torch.cuda.is_available():  # the FLARE blocks need nvflare (tests_nvflare/ runs them)
        exec(compile(code, "README.md", "exec"), {"__name__": "readme_block"})


@pytest.mark.parametrize("code", _python("flower"))
def test_flower_block_runs_as_a_server_app(code):
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_flower_strategies import Grid, clients_for_round  # a Grid whose nodes train (and Message setup)
    finally:
        sys.path.remove(str(ROOT / "tests"))
    ns = {"__name__": "readme_block"}
    exec(compile(code, "README.md", "exec"), ns)
    nodes = list(range(1, 7))
    client = clients_for_round(1, nodes)
    calls = []

    def train(msg):
        calls.append(msg.metadata.message_type)
        return client(msg)
    grid = Grid(nodes, lambda msg: train(msg) if msg.metadata.message_type.startswith("train") else _evaluate(msg))
    ns["main"](grid, None)
    assert calls.count("train") == 10 * 6  # the block runs its second strategy, FedExP: every node, 10 rounds


def _evaluate(msg):
    from flwr.app import Message, MetricRecord, RecordDict

    return Message(content=RecordDict({"metrics": MetricRecord({"num-examples": 1, "loss": 0.5})}), reply_to=msg)


@pytest.mark.parametrize("code", _python("distributed"))
def test_distributed_block_runs_on_two_ranks(code, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "block.py"
    # the block as written, then what each rank ended with (fastagg.server holds its group weakly: an optimizer
    # holding it past destroy_process_group made gloo abort at interpreter exit, 1 run in 4-10)
    script.write_text(code.replace("dist.barrier()", "print(repr(w.sum().item()), repr(float(next(model"
                                   ".parameters()).detach().sum())))\ndist.barrier()"))
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(f"rank {r}: {o[1][-3000:]}" for r, o in enumerate(outs))
    assert outs[0][0] == outs[1][0] and outs[0][0].strip(), outs  # every rank took the same step


def _commands(code: str) -> list:
    """The block's commands: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    cmds = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            cmds.append(line)
    return cmds


SHELL = [pytest.param(cmd, id=cmd[:60]) for lang, code, _ in BLOCKS if lang == "bash" for cmd in _commands(code)]


@pytest.mark.parametrize("cmd", SHELL)
def test_shell_command_runs(cmd, tmp_path):
    skip_reason = next((why for prefix, why in NOT_RUN.items() if cmd.startswith(prefix)), None)
    if skip_reason:
        assert "make test-package" not in skip_reason or "make test-package" in (ROOT / ".ci" / "run").read_text()
        return
    if cmd == "make run":  # the Makefile's own command for it, with this interpreter
        recipe = re.search(r"^run:.*\n\t\$\(PY\) (.*)$", (ROOT / "Makefile").read_text(), re.M)
        args = shlex.split(recipe.group(1))
    else:
        args = shlex.split(cmd)
        assert args[0] == "python", cmd
        args = args[1:]
        args += ["--quick", "--claims", "5", "--overwrite"] if "fastagg.sim.reproduce" in args else ["--rounds", "2"]
    toml = next(code for lang, code, _ in BLOCKS if lang == "toml")
    (tmp_path / "runs.toml").write_text(toml)
    r = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}"
    for out in re.findall(r"--out (\S+)", " ".join(args)):
        assert (tmp_path / out).is_dir(), out


def test_the_toml_block_is_a_valid_config():
    import tomllib

    from fastagg.sim.runner import checked_settings

    for lang, code, _ in BLOCKS:
        if lang == "toml":
            checked_settings(tomllib.loads(code), "README's runs.toml")


def test_every_path_in_the_layout_exists():
    layout = next(code for lang, code, _ in BLOCKS if lang == "text")
    paths = [line.split()[0] for line in layout.splitlines() if line.strip()]
    assert len(paths) > 20
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
