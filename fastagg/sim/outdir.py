"""A run's output folder, kept safe: one run writes it at a time (a lock file), a finished or stopped run's
results are never overwritten unless asked (``--overwrite``), and a checkpoint is loaded without executing
anything it contains (``weights_only``) and only into the run it belongs to."""
from __future__ import annotations

import errno
import os
import warnings

import torch

LOCK = ".fastagg-sim.lock"
RESULTS = ("metrics.csv", "checkpoint.pt", "config.json")
CHECKPOINT = "checkpoint.pt"
SIGNATURE = ("dataset", "model", "algorithms", "seeds", "clients", "dirichlet", "dtype")


class Lock:
    """The folder's lock file, holding the owner's pid; ``release()`` removes it."""

    def __init__(self, path: str):
        self.path = path

    def release(self) -> None:
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(out: str, *, resume: bool, overwrite: bool) -> Lock:
    """Make ``out`` this run's: create it, refuse one that holds another run's results (unless ``resume`` or
    ``overwrite``), refuse one another live run is writing, and take its lock. Raises ValueError, one line."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --out {out!r}: {e.strerror}") from e
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} is not writable")
    path = os.path.join(out, LOCK)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise ValueError(f"another run (pid {pid}) is writing to {out!r}; wait for it or choose another "
                                 "--out") from None
            os.remove(path)  # a killed run's stale lock
            continue
        except OSError as e:
            raise ValueError(f"cannot write to --out {out!r}: {os.strerror(e.errno or errno.EACCES)}") from e
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    lock = Lock(path)
    if not resume and not overwrite:
        held = [name for name in RESULTS if os.path.exists(os.path.join(out, name))]
        if held:
            lock.release()
            raise ValueError(f"{out!r} already holds a run ({', '.join(held)}); pass --overwrite to replace it or "
                             "--resume to continue it")
    return lock


def signature(cfg) -> dict:
    """What makes a checkpoint belong to a run: its data set, model, algorithms, seeds, clients and dtype."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in ((k, getattr(cfg, k)) for k in SIGNATURE)}


def save_checkpoint(out: str, ckpt: dict) -> None:
    """Written to a temporary file and renamed: a killed process leaves the previous checkpoint whole."""
    tmp = os.path.join(out, CHECKPOINT + ".tmp")
    torch.save(ckpt, tmp)
    os.replace(tmp, os.path.join(out, CHECKPOINT))


def load_checkpoint(out: str, cfg) -> dict:
    """The checkpoint in ``out``, loaded with ``weights_only=True`` (tensors and plain containers only: a crafted
    file cannot run code), checked to be this run's before anything is written."""
    path = os.path.join(out, CHECKPOINT)
    try:
        with warnings.catch_warnings():  # torch warns about a foreign pickle protocol before refusing it
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"nothing to resume: no {CHECKPOINT} in {out!r}") from None
    except Exception as e:  # an unpickling error, a truncated file...: one line, no traceback
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"cannot load {path!r} as a checkpoint ({type(e).__name__}: {first[:160]})") from None
    if not isinstance(ckpt, dict) or not {"rows", "done", "current", "run"} <= set(ckpt):
        raise ValueError(f"{path!r} is not a fastagg-sim checkpoint (missing entries)")
    mine, theirs = signature(cfg), ckpt["run"]
    if not isinstance(theirs, dict) or theirs != mine:
        theirs = theirs if isinstance(theirs, dict) else {}
        diff = [k for k in SIGNATURE if theirs.get(k) != mine.get(k)]
        shown = ", ".join(f"{k}={theirs.get(k)!r}" for k in diff)
        raise ValueError(f"{path!r} belongs to another run: its {', '.join(diff)} differ from {out!r}'s config.json "
                         f"({shown})")
    return ckpt
