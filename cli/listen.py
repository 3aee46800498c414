"""The listening socket of ``mlxkv serve``, bound before the model loads: a busy port or a bad address fails in
one line at once, and ``--port 0`` reports the port the system picked."""

from __future__ import annotations

import socket


class ListenError(Exception):
    """The address cannot be listened on; the message is one line for the user."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (not yet listening; uvicorn listens on it), as uvicorn binds one:
    IPv6 for an address with a colon, ``SO_REUSEADDR`` so a restart need not wait for old connections.

    Raises:
        ListenError: the port is taken, the address is not this machine's, or the name does not resolve.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {url(host, port)}: {reason.lower()}") from None
    except (UnicodeError, ValueError, TypeError) as exc:  # a name the resolver cannot even encode
        sock.close()
        raise ListenError(f"cannot listen on {url(host, port)!r}: not a host name or address ({exc})") from None
    sock.set_inheritable(True)
    return sock


def url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 address in brackets (``http://[::]:8080``)."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def bound_port(sock: socket.socket) -> int:
    """The port ``sock`` is bound to (the system's pick for port 0)."""
    return sock.getsockname()[1]


__all__ = ["ListenError", "bind", "url", "bound_port"]
