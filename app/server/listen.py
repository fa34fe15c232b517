"""Claiming the server's address before anything loads: the listening socket is bound first and
handed to uvicorn, and a taken port is one line that says who holds it."""

from __future__ import annotations

import errno
import http.client
import os
import socket

from localchat.errors import LocalchatError

ROOT_TEXT = "localchat is running"  # what `GET /` answers (Ollama's says "Ollama is running")
OLLAMA_ROOT_TEXT = "Ollama is running"
PROBE_TIMEOUT_S = 0.5
_IN_USE = {errno.EADDRINUSE, getattr(errno, "WSAEADDRINUSE", errno.EADDRINUSE)}
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class AddressError(LocalchatError):
    """The server cannot listen where it was asked to (the port is taken, or the host is not
    an address of this machine)."""


def display_address(host: str, port: int) -> str:
    """host:port as a URL writes it ([::1]:11434 for IPv6)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: any free port); AddressError when it cannot."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if os.name == "posix":  # a restart need not wait out the last run's TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
    except OSError as exc:
        sock.close()
        raise bind_error(exc, host, port) from None
    return sock


def bind_error(exc: OSError, host: str, port: int) -> AddressError:
    """The one-line error for a failed bind, naming the listener when the port is taken."""
    address = display_address(host, port)
    if exc.errno in _IN_USE:
        return AddressError(f"{address} is already in use ({who_listens(host, port)}); "
                            f"pass --port N to use another port")
    if exc.errno == errno.EACCES:
        return AddressError(f"cannot listen on {address}: permission denied (ports below 1024 "
                            f"need privileges); pass --port N to use another port")
    if isinstance(exc, socket.gaierror):
        return AddressError(f"cannot listen on {address}: unknown host {host!r}; pass --host "
                            f"with an address of this machine (default 127.0.0.1)")
    if exc.errno == errno.EADDRNOTAVAIL:
        return AddressError(f"cannot listen on {address}: {host!r} is not an address of this "
                            f"machine; pass --host with one (default 127.0.0.1)")
    return AddressError(f"cannot listen on {address}: {exc.strerror or exc}")


def who_listens(host: str, port: int) -> str:
    """Who holds host:port, from a short `GET /`: a localchat server, Ollama, or another."""
    target = _LOOPBACK.get(host, host)
    conn = http.client.HTTPConnection(target, port, timeout=PROBE_TIMEOUT_S)
    try:
        try:
            conn.connect()
        except OSError:
            return "another program holds it"
        try:
            conn.request("GET", "/", headers={"User-Agent": "localchat-serve"})
            response = conn.getresponse()
            body = response.read(256).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            return "another program is listening there"
        server = "".join(c for c in response.getheader("server") or "" if c.isprintable()).strip()
    finally:
        conn.close()
    if body.startswith(ROOT_TEXT):
        return "a localchat server is listening there"
    if OLLAMA_ROOT_TEXT in body:
        return "Ollama is listening there"
    return f"{server[:40] or 'another HTTP server'} is listening there"
