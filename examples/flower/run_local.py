"""Run the example app the way Flower 1.42 runs an app on one machine: ``flwr run`` into the managed local SuperLink
in simulation mode (Flower's default ``local`` connection), with Flower's default runtime dependency installation:

    python examples/flower/run_local.py --strategy fedexp --model cnn --rounds 5 --clients 4

It is ``flwr run examples/flower --stream --federation-config num-supernodes=4 --run-config ...`` with a private
FLWR_HOME (a temporary directory) and free ports, so your own Flower setup is left alone; the SuperLink Flower
starts for it runs detached, and is stopped at the end. Prints each round's client metrics and the server's
statistics (FedExP's eta: above 1 when it extrapolates). ``--strategy flower-fedadam`` runs Flower's own FedAdam.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _superlinks_on(port: int) -> list[int]:
    """PIDs of flower-superlink processes listening on ``port`` (Linux /proc; elsewhere none are found)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"flower-superlink") for a in argv) and str(port).encode() in argv:
            found.append(int(proc.name))
    return found


def _started_under(home: str) -> list[int]:
    """PIDs of processes whose environment holds FLWR_HOME=home: everything this run started, however detached."""
    marker = f"FLWR_HOME={home}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0") and int(proc.name) != os.getpid():
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def _stop_one(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        end = time.monotonic() + 5.0
        while time.monotonic() < end and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)


def _stop(pid: int) -> None:
    """The managed SuperLink leads its own process group (its runtime processes are in it): end the group."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="fedexp")
    p.add_argument("--model", default="cnn", choices=["cnn", "linear"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--buffers", default="average", choices=["average", "optimizer"])
    p.add_argument("--out", default="", help="also write the summary here (JSON)")
    a = p.parse_args()

    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="flwr-home-") as home:
        http_port = _free_port()
        out = Path(a.out).resolve() if a.out else Path(home) / "result.json"
        env = dict(os.environ, FLWR_HOME=home, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
                   FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(http_port), FLWR_LOCAL_CONTROL_API_PORT=str(_free_port()),
                   RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0", PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        # every round waits for all the clients (min-nodes), so runs of two strategies average the same clients
        run_config = (f"strategy='{a.strategy}' model='{a.model}' num-server-rounds={a.rounds} min-nodes={a.clients} "
                      f"buffers='{a.buffers}' out-file='{out}'")
        cmd = [str(bin_dir / "flwr"), "run", str(HERE), "--stream", "--federation-config",
               f"num-supernodes={a.clients}", "--run-config", run_config]
        t0 = time.time()
        try:
            rc = subprocess.run(cmd, env=env, timeout=1800).returncode
        finally:
            for pid in _superlinks_on(http_port):
                _stop(pid)
            for pid in _started_under(home):  # what it started outside its group (flower-superexec)
                _stop_one(pid)
        if rc != 0 or not out.exists():  # flwr run exits 0 even when the ServerApp failed: the file says it ran
            print(f"the run failed (flwr run exited {rc}; no result file): see the log above", file=sys.stderr)
            return 1
        s = json.loads(out.read_text())
    for r in sorted(s["train"], key=int):
        server = s.get("server", {}).get(r, {})
        print(f"round {r}: train {json.dumps(s['train'][r])}  eval {json.dumps(s['eval'].get(r, {}))}"
              + (f"  server {json.dumps({k: round(v, 4) for k, v in server.items()})}" if server else ""))
    print(f"{a.strategy}: {a.rounds} rounds, {a.clients} clients in {time.time() - t0:.1f} s (flwr run, local "
          "simulation)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
