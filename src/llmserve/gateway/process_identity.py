"""Who owns an idempotency lease: a process identity that outlives the process.

An in-progress idempotency record names the process that runs it (its *owner*), so
that a later process can tell whether the owner is still alive: a server killed with
``kill -9`` never releases its leases, and without an owner they would block their keys
until the lease ran out (an hour by default).

The identity is ``host|boot_id|pid|start``: the host name, the kernel's boot id (Linux:
``/proc/sys/kernel/random/boot_id``), the process id and the process's start time in
clock ticks since boot (``/proc/<pid>/stat``, field 22), so a recycled pid is not
mistaken for the owner. :meth:`ProcessIdentity.is_alive` answers

* ``False`` when the owner is certainly gone: same host and a different boot, or the
  pid no longer exists, is a zombie, or belongs to a process that started at another
  time;
* ``True`` when it certainly or probably runs (same pid and start time, or the pid
  exists and its start time cannot be read);
* ``None`` when it cannot be known (another host): the lease then runs its course.
"""
from __future__ import annotations

import functools
import logging
import os
import socket
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

_BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def _read_boot_id() -> str:
    try:
        with open(_BOOT_ID_PATH, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def _read_stat(pid: int) -> Optional[tuple[str, str]]:
    """(state, start time) of a process from ``/proc/<pid>/stat``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses
    fields = text[text.rfind(")") + 2:].split()
    if len(fields) < 20:
        return None
    return fields[0], fields[19]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, identified across hosts, reboots and pid reuse."""

    host: str
    boot_id: str
    pid: int
    start: str

    @property
    def token(self) -> str:
        """The string stored in the database."""
        return f"{self.host}|{self.boot_id}|{self.pid}|{self.start}"

    @classmethod
    def parse(cls, token: Optional[str]) -> Optional["ProcessIdentity"]:
        """The identity a :attr:`token` describes; None for a missing or malformed one."""
        if not token:
            return None
        parts = token.rsplit("|", 3)
        if len(parts) != 4 or not parts[2].isdigit():
            return None
        return cls(parts[0], parts[1], int(parts[2]), parts[3])

    @classmethod
    def of_pid(cls, pid: int) -> "ProcessIdentity":
        """The identity of a running process of this host."""
        stat = _read_stat(pid)
        return cls(socket.gethostname(), _read_boot_id(), pid, stat[1] if stat else "")

    def is_alive(self) -> Optional[bool]:
        """Whether the process still runs (see the module docstring); None if unknowable."""
        here = current_process()
        if self.host != here.host:
            return None
        if self.boot_id and here.boot_id and self.boot_id != here.boot_id:
            return False
        if self.pid == here.pid:
            return self.start == here.start
        stat = _read_stat(self.pid)
        if stat is None:
            return _pid_exists(self.pid)
        state, start = stat
        if state in ("Z", "X", "x"):
            return False
        return not self.start or start == self.start


@functools.lru_cache(maxsize=1)
def _current(pid: int) -> ProcessIdentity:
    return ProcessIdentity.of_pid(pid)


def current_process() -> ProcessIdentity:
    """This process's identity (recomputed after a fork)."""
    return _current(os.getpid())


def owner_is_dead(token: Optional[str]) -> bool:
    """True when the process a lease token names is certainly gone."""
    owner = ProcessIdentity.parse(token)
    return owner is not None and owner.is_alive() is False
