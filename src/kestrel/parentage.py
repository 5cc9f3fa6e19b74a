"""A child process that ends with its parent: the supervisor's workers, the runtime the
demo starts. Linux's ``PR_SET_PDEATHSIG`` sends the child a signal when its parent dies,
however it dies (a SIGKILL included); elsewhere the callers' own checks of the parent still
run."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(expected_parent: int, signum: int = signal.SIGUSR1) -> None:
    """In a child (after fork): get *signum* when the parent dies (Linux); exit at once if it
    died already. A worker gets SIGUSR1 (release and exit now); the runtime the demo starts,
    SIGTERM (drain)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):  # not Linux: the caller's ppid check still runs
        pass
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(0)
