"""A child process that dies with the process that spawned it, by the kernel's hand.

``die_with_parent(pid)`` asks Linux (``prctl(PR_SET_PDEATHSIG, SIGTERM)``) to send this process
SIGTERM the moment its parent exits, however it exits (``kill -9`` included): no polling, so a busy
or loaded worker goes at once rather than when a watcher thread next runs. Python leaves SIGTERM at
its default action, so the process ends without running a line of its own. The signal is tied to
the parent *thread* that forked us: the head spawns its workers from its event loop thread, which
lives as long as the head. Where the call is unavailable (not Linux) it returns False and the
worker's own watch of ``os.getppid()`` (``Worker._parent_gone``) is what remains.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def die_with_parent(parent_pid: int, sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (``parent_pid``) exits. If the
    parent is already gone (we were re-parented before the call took effect), this process gets
    ``sig`` now. Returns whether the kernel will do it (False off Linux, or if prctl failed)."""
    if not sys.platform.startswith("linux"):
        return False
    if _libc().prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl: nobody will signal us
        os.kill(os.getpid(), sig)
    return True


def parent_death_signal() -> int:
    """This process's parent-death signal (0: none), as the kernel holds it."""
    if not sys.platform.startswith("linux"):
        return 0
    out = ctypes.c_int(0)
    _libc().prctl(PR_GET_PDEATHSIG, ctypes.byref(out), 0, 0, 0)
    return out.value
