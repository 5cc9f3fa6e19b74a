"""Where the client processes' CPU goes, on each side of a bench run (``bench.run --py-spy``).

py-spy samples a side's processes for as long as its workflows run: kestrel's supervisor and
its workers, or a floor's loop processes (the bench's own children). The raw samples are
written next to the results; :func:`summary` folds them into the functions that hold the
most samples, by their own time (the frame on top) and inclusively (anywhere on the stack).
Idle time (a process waiting in ``epoll``) is not sampled, so the shares are of CPU time.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

RATE = 250
"""Samples a second."""

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^():]*?)(?::\d+)?\)$")


class NotAvailable(RuntimeError):
    """py-spy is not installed, or may not attach to processes here."""


def check() -> str:
    """py-spy's path; :class:`NotAvailable` when it is missing."""
    path = shutil.which("py-spy")
    if path is None:
        raise NotAvailable("--py-spy needs py-spy on PATH (pip install py-spy; the "
                           "project's dev extra has it)")
    return path


class Recorder:
    """py-spy recording *pid* and its children into *out* until :meth:`stop`."""

    def __init__(self, pid: int, out: Path) -> None:
        self.out = out
        self._stopped = False
        out.parent.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [check(), "record", "--pid", str(pid), "--subprocesses", "--rate", str(RATE),
             "--format", "raw", "--nonblocking", "--output", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> Path | None:
        """End the recording (py-spy writes its file on SIGINT); the file, or None when
        py-spy could not record (its complaint is printed). Only the first call does it."""
        if self._stopped:
            return self.out if self.out.exists() else None
        self._stopped = True
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGINT)
        try:
            _, err = self._proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            _, err = self._proc.communicate()
        if not self.out.exists():
            print(f"  py-spy recorded nothing: {err.decode(errors='replace').strip()[:300]}")
            return None
        return self.out


def _name(frame: str) -> tuple[str, str]:
    """A frame as ``function (file)`` and the package it belongs to: the first part of its
    path as py-spy prints it (``kestrel``, ``psycopg``, ``asyncio``), or the module of a
    file that stands alone (``selectors``), or ``<frozen …>``."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), "?"
    path = m["file"]
    first = path.split("/", 1)[0]
    package = first.removesuffix(".py") if "/" in path or first.endswith(".py") else first
    return f"{m['func']} ({Path(path).name})", package


def _idle(frame: str) -> bool:
    """A sample whose top frame waits in the event loop's poll: the process was idle (py-spy
    with ``--nonblocking`` cannot always tell)."""
    return frame.startswith(("select (selectors.py)", "EpollSelector.select (selectors.py)"))


class Profile:
    """Samples of one raw py-spy file, folded: the busy ones (not :func:`_idle`) per
    function, own and inclusive, and per package of the top frame."""

    def __init__(self, raw: Path) -> None:
        self.total = self.idle = 0
        self.own: Counter[str] = Counter()
        self.inclusive: Counter[str] = Counter()
        self.packages: Counter[str] = Counter()
        for line in raw.read_text(errors="replace").splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [_name(f) for f in stack.split(";")
                      if f and not f.startswith("process ")]
            if not frames:
                continue
            self.total += n
            if _idle(frames[-1][0]):
                self.idle += n
                continue
            self.own[frames[-1][0]] += n
            self.packages[frames[-1][1]] += n
            for name in {f[0] for f in frames}:
                self.inclusive[name] += n

    @property
    def busy(self) -> int:
        """Samples of a process at work."""
        return self.total - self.idle


def summary(name: str, raw: Path, limit: int = 12) -> str:
    """The top of *raw*'s profile as text under *name*: the busy samples by package of the
    top frame, and the functions with the most of their own."""
    prof = Profile(raw)
    if not prof.busy:
        return f"{name}: no busy samples ({raw})"
    busy = prof.busy
    lines = [f"{name}: {busy} busy samples at {RATE}/s ({prof.idle} more waiting in "
             f"epoll, left out; {raw})",
             "  by package of the top frame: " + ", ".join(
                 f"{pkg} {100 * n / busy:.0f}%" for pkg, n in prof.packages.most_common(8)),
             f"  {'own %':>6} {'incl %':>6}  function"]
    for func, n in prof.own.most_common(limit):
        lines.append(f"  {100 * n / busy:6.1f} {100 * prof.inclusive[func] / busy:6.1f}  "
                     f"{func}")
    return "\n".join(lines)
