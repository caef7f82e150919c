"""A run's output folder, kept safe: one run writes it at a time (a lock the kernel holds for a live process only),
a finished or stopped run's results are never overwritten unless asked (``--overwrite``), nothing is ever written
through a symbolic link planted in it (files are created fresh, without following links, and renamed into
place), and a checkpoint is loaded without executing anything it contains (``weights_only``) and only into the
run it belongs to."""
from __future__ import annotations

import csv
import dataclasses
import errno
import fcntl
import os
import re
import stat
import warnings
from typing import Callable

import torch

LOCK = ".fastagg-sim.lock"
RESULTS = ("metrics.csv", "checkpoint.pt", "config.json")
CHECKPOINT = "checkpoint.pt"
# the settings a checkpoint signed before fastagg 2026-11-28 (a checkpoint whose "run" holds these keys alone): a
# folder written then is still resumed when they match, with a warning that its other settings are not checked
LEGACY_SIGNATURE = ("dataset", "model", "algorithms", "seeds", "clients", "dirichlet", "dtype")
# the settings a resumed run may change: rounds (a finished run extended) and out (the folder, wherever it moved);
# every other setting of the resolved config changes the results and is part of a saved state's signature
UNSIGNED = ("rounds", "out")
SIGNATURE_VERSION = 2


class Lock:
    """The folder's lock: the lock file, held with ``flock`` (the kernel drops it when the process dies, however it
    dies, so a killed run never leaves a folder locked), holding the owner's pid for the message others get."""

    def __init__(self, path: str, fd: int):
        self.path, self.fd = path, fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:  # unlinked while still held: a run that opened this file meanwhile sees it is gone and retries
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def claim(out: str, *, resume: bool, overwrite: bool) -> Lock:
    """Make ``out`` this run's: create it, refuse one that holds another run's results (unless ``resume`` or
    ``overwrite``), refuse one another live run is writing, and take its lock. Two runs can never both hold a
    folder: the lock is taken with ``flock`` on the file that is at the lock's path at that moment. Raises
    ValueError, one line."""
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create --out {out!r}: {e.strerror}") from e
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} is not writable")
    path = os.path.join(out, LOCK)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else "a directory" if e.errno == errno.EISDIR else \
                os.strerror(e.errno or errno.EACCES)
            raise ValueError(f"cannot use the lock file {path!r}: it is {why}; remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ValueError(f"another run (pid {holder}) is writing to {out!r}; wait for it or choose another "
                             "--out") from None
        try:  # the file locked must be the one at the path now (another run may have released and unlinked it)
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        mine = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    lock = Lock(path, fd)
    if not resume and not overwrite:
        held = [name for name in RESULTS if os.path.lexists(os.path.join(out, name))]
        if held:
            lock.release()
            raise ValueError(f"{out!r} already holds a run ({', '.join(held)}); pass --overwrite to replace it or "
                             "--resume to continue it")
    return lock


def open_new(out: str, name: str, *, binary: bool = False):
    """A fresh file ``name`` in ``out``, opened for writing: whatever entry has that name is removed first (a file,
    or a symbolic link someone planted: the link itself, never what it points to), and the file is created
    exclusively without following links. Raises ValueError (one line) when that cannot be done."""
    path = os.path.join(out, name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"cannot replace {path!r}: {os.strerror(e.errno or errno.EACCES)}") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:  # re-planted between the unlink and the open
        raise ValueError(f"cannot create {path!r}: {os.strerror(e.errno or errno.EACCES)}") from None
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", newline="")


def write_file(out: str, name: str, write: Callable, *, binary: bool = False) -> None:
    """``name`` in ``out`` written whole or not at all: ``write(f)`` fills a fresh temporary file (:func:`open_new`),
    which is then renamed over ``name`` (a rename replaces a link at ``name`` itself, never its target)."""
    tmp = name + ".tmp"
    with open_new(out, tmp, binary=binary) as f:
        write(f)
    os.replace(os.path.join(out, tmp), os.path.join(out, name))


def signature(cfg) -> dict:
    """What makes a saved state (checkpoint.pt, a finished run's final-A-S.pt) belong to a run: every setting of its
    resolved config but ``UNSIGNED`` (lr, participation, the attack, --dp with its seed, --compress, the local
    steps... any of which changes the trajectory), kept whole so a mismatch names the setting."""
    settings = {f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v
                for f in dataclasses.fields(cfg) if f.name not in UNSIGNED}
    return {"version": SIGNATURE_VERSION, "settings": settings}


def is_legacy(sig) -> bool:
    """A signature written before every setting was signed (``LEGACY_SIGNATURE``'s keys alone)."""
    return isinstance(sig, dict) and set(sig) == set(LEGACY_SIGNATURE)


def check_signature(sig, cfg, path: str, out: str) -> None:
    """``sig`` (a saved state's "run") is ``cfg``'s :func:`signature`; else a one-line ValueError naming the first
    setting that differs. A legacy signature (``is_legacy``) is checked on its own keys, with a warning that the
    other settings cannot be."""
    if is_legacy(sig):
        mine = {k: list(v) if isinstance(v := getattr(cfg, k), tuple) else v for k in LEGACY_SIGNATURE}
        theirs = sig
        if theirs == mine:
            warnings.warn(f"{path!r} was saved before checkpoints recorded every setting: only its "
                          f"{', '.join(LEGACY_SIGNATURE)} are checked against {out!r}'s config.json", stacklevel=3)
            return
    else:
        mine = signature(cfg)["settings"]
        theirs = sig.get("settings") if isinstance(sig, dict) and sig.get("version") == SIGNATURE_VERSION else None
        if theirs == mine:
            return
        if not isinstance(theirs, dict):
            raise ValueError(f"{path!r} belongs to another run: it carries no signature of its settings (not "
                             f"saved by this run of {out!r})")
    diff = [k for k in mine if k not in theirs or theirs[k] != mine[k]] + sorted(set(theirs) - set(mine))
    k = diff[0]
    more = f" (and {len(diff) - 1} more: {', '.join(diff[1:4])}{', ...' if len(diff) > 4 else ''})" \
        if len(diff) > 1 else ""
    raise ValueError(f"{path!r} belongs to another run: it was saved with {k}={theirs.get(k, '(unset)')!r:.60}; "
                     f"{os.path.join(out, 'config.json')!r} has {k}={mine.get(k, '(unset)')!r:.60}{more}")


def save_checkpoint(out: str, ckpt: dict) -> None:
    """Written to a temporary file and renamed: a killed process leaves the previous checkpoint whole."""
    write_file(out, CHECKPOINT, lambda f: torch.save(ckpt, f), binary=True)


def load_checkpoint(out: str, cfg) -> dict:
    """The checkpoint in ``out``, loaded with ``weights_only=True`` (tensors and plain containers only: a crafted
    file cannot run code), checked to be this run's before anything is written."""
    path = os.path.join(out, CHECKPOINT)
    if not os.path.lexists(path):
        raise ValueError(f"nothing to resume: no {CHECKPOINT} in {out!r}")
    ckpt = _load(path, "as a checkpoint")
    if not isinstance(ckpt, dict) or not {"done", "current", "run"} <= set(ckpt) or \
            not ({"rows", "rows_written"} & set(ckpt)):
        raise ValueError(f"{path!r} is not a fastagg-sim checkpoint (missing entries)")
    check_signature(ckpt["run"], cfg, path, out)
    return ckpt


def read_metrics(out: str, count: int, fields: list) -> list:
    """The first ``count`` rows of ``out``'s metrics.csv, typed (algorithm: str; seed, round: int; the rest:
    float), read without following a link planted at its name. Raises ValueError (one line) when the file is
    missing, has another header, fewer rows or a malformed value."""
    path = os.path.join(out, "metrics.csv")
    try:
        fd = open_regular(path)
    except OSError as e:
        raise ValueError(f"cannot read {path!r} (the checkpoint's metrics): {e.strerror or os.strerror(errno.EIO)}") \
            from None
    rows = []
    with os.fdopen(fd, newline="") as f:
        reader = csv.reader(f)
        if next(reader, None) != list(fields):
            raise ValueError(f"{path!r} is not this simulator's metrics file (its header differs)")
        for line, values in enumerate(reader, start=2):
            if len(rows) == count:
                break
            try:
                if len(values) != len(fields):
                    raise ValueError(f"{len(values)} values")
                row = dict(zip(fields, values))
                rows.append({k: v if k == "algorithm" else int(v) if k in ("seed", "round") else float(v)
                             for k, v in row.items()})
            except ValueError as e:
                raise ValueError(f"{path!r} line {line} is malformed ({e})") from None
    if len(rows) < count:
        raise ValueError(f"{path!r} holds {len(rows)} metric rows; the checkpoint recorded {count}")
    return rows


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``: never through a symbolic link, and never blocking on
    a FIFO or a device planted at the name (opened non-blocking, then refused). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    os.set_blocking(fd, True)
    return fd


FINAL_STATE = re.compile(r"final-[0-9]+-[0-9]+\.pt")  # the names _run_all gives finished runs' states


def load_state(out: str, name: str) -> dict:
    """A state file of ``out`` (a finished run's final state), loaded with ``weights_only=True`` (a crafted file
    cannot run code); a missing or unreadable file is a one-line ValueError."""
    if not isinstance(name, str) or not FINAL_STATE.fullmatch(name):  # never a path out of the folder
        raise ValueError(f"{os.path.join(out, CHECKPOINT)!r} names the state file {name!r:.80}; expected "
                         "final-A-S.pt in the run's folder")
    path = os.path.join(out, name)
    state = _load(path, "as a run's state")
    if not isinstance(state, dict):
        raise ValueError(f"{path!r} is not a run's state")
    return state


def _load(path: str, what: str):
    """``torch.load(path, weights_only=True)``: tensors and plain containers only (a crafted file cannot run code);
    a missing, truncated or foreign file is a one-line ValueError, never a traceback."""
    try:  # never through a link planted at the name (it could point at a device or another run's file)
        fd = open_regular(path)
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror or os.strerror(errno.EIO)
        raise ValueError(f"cannot load {path!r} {what}: {why}") from None
    try:
        with os.fdopen(fd, "rb") as f, warnings.catch_warnings():  # torch warns about a foreign pickle protocol
            warnings.simplefilter("ignore")
            return torch.load(f, weights_only=True)
    except Exception as e:  # an unpickling error, a truncated file...
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"cannot load {path!r} {what} ({type(e).__name__}: {first[:160]})") from None
