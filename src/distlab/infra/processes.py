"""Process trees: every process under a pid, and killing all of them, on Linux and macOS
alike (psutil reads /proc on one and asks the kernel through sysctl on the other).

    # a torchrun node: the launcher, and each worker in its own session
    kill_tree(node.pid)
    # running: a zombie is not
    alive(pid)
"""

from __future__ import annotations

import os
import signal
import time

import psutil


def tree(pid: int) -> list[int]:
    """``pid`` and every process under it."""
    try:
        return [
            pid,
            *(child.pid for child in psutil.Process(pid).children(recursive=True)),
        ]
    # it has gone; its children, if any, now belong to init (or a subreaper)
    except psutil.NoSuchProcess:
        return [pid]


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie (exited, its status not yet collected by
    its parent)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    # psutil's ZombieProcess, raised on some systems, is one too
    except psutil.NoSuchProcess:
        return False


def kill_tree(pid: int) -> None:
    """SIGTERM, then SIGKILL, to the process group of every process under ``pid``:
    torchrun starts each worker in a session of its own, which a kill of its group alone
    would miss."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups = set()
        for p in tree(pid):
            try:
                groups.add(os.getpgid(p))
            except ProcessLookupError:
                pass
        groups.discard(os.getpgid(0))  # never our own group
        for group in groups:
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGTERM and groups:
            # a moment for the launcher to stop its workers itself
            end = time.monotonic() + 3
            while time.monotonic() < end and any(alive(p) for p in tree(pid)):
                time.sleep(0.05)
