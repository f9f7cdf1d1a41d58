"""Rendezvous ports on 127.0.0.1: one the OS picks, and a check that a chosen one
is free.

port = free_port()        # free now; pass it to every node of a job
check_port_free(29500)    # PortInUse, with the cause, instead of a rendezvous that
waits forever
"""

from __future__ import annotations

import socket


class PortInUse(OSError):
    """The rendezvous port asked for is taken; nothing was started."""


def free_port() -> int:
    """A port on 127.0.0.1 that is free now. Another program could take it before it is
    bound; ``check_port_free`` just before starting says so instead of waiting forever.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_port_free(port: int) -> None:
    # torchrun's c10d rendezvous on a port some other program listens on waits forever
    # (measured with torch 2.13), so refuse up front with the cause
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise PortInUse(
                f"port {port} on 127.0.0.1 is already in use; pick another or "
                "omit it to let the OS choose a free one"
            ) from None
