"""Named child processes that never outlive their parent.

Each child runs in its own session (a terminal's Ctrl-C reaches only the parent, which then stops
the children in order) and gets SIGTERM from the kernel if the parent dies without stopping it
(Linux PR_SET_PDEATHSIG), so nothing is left running whatever happens to the parent.

The death signal is set by the child itself: a tiny interpreter (`_GUARD`) sets it, checks the
parent is still the one that started it, then execs the real program (the signal survives exec).
It is not set in a `preexec_fn`: that makes Python fork (not vfork) and run code in the child,
where gRPC's fork handlers, in a parent with RPCs in flight, crash the child before it execs
(SIGSEGV / SIGABRT "epoll_wait: Bad file descriptor"; most children of a busy parent died so
in tests/test_process.py's reproduction).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# argv: PARENT_PID PROGRAM ARGS... (prctl 1 is PR_SET_PDEATHSIG, 15 SIGTERM). Run with -I -S: no
# site, no user paths, nothing of ours imported, ~10 ms.
_GUARD = """\
import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 15)
if os.getppid() != int(sys.argv[1]):
    sys.exit("parent gone before start")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _guarded(argv: list[str]) -> list[str]:
    """argv run under `_GUARD` (Linux; elsewhere argv as it is)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]


class Child:
    """One named child process."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, **popen):
        self.name = name
        self.argv = list(argv)
        self.proc = subprocess.Popen(_guarded(self.argv), env=env, start_new_session=True, **popen)
        self.terminating = False  # SIGTERM sent
        logger.debug("started %s (pid %d): %s", name, self.proc.pid, " ".join(self.argv))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.terminating |= sig == signal.SIGTERM

    def stop(self, timeout: float) -> int:
        """SIGTERM (unless sent already), wait up to `timeout` seconds for a clean exit, then
        SIGKILL. One SIGTERM only: a second could land after the child has stopped and dropped
        its handler, and end a clean exit as killed."""
        if not self.terminating:
            self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit %.0fs after SIGTERM; killing it", self.name, timeout)
            self.proc.kill()
            return self.proc.wait()

    def __repr__(self) -> str:
        return f"Child({self.name!r}, pid={self.proc.pid}, returncode={self.proc.returncode})"


def epd_command(*args: str) -> list[str]:
    """argv that runs `epd ARGS...` with this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "epd", *args]


# Ports free_port has handed out in this process: asked twice before the first is bound, the
# OS may well pick the same port again.
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that nothing listens on right now (the OS picks it) and that this process has
    not been given before: ports picked one after another for roles not started yet (a
    proxy's gRPC and HTTP ports) differ."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with _handed_out_lock:
        for _ in range(100):
            with socket.socket(family) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process was not given already")


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True
