"""Running the API: uvicorn on a thread of this process, on a socket bound before it starts (so a
port already taken is a one-line error, and port 0 picks a free one)."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from nemo_like.serve.app import build_app
from nemo_like.serve.sessions import SessionStore


class ServeError(RuntimeError):
    """The server cannot start (the port is taken, the host cannot be bound)."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int, *, key: str = "serve.port") -> socket.socket:
    """A listening socket on (host, port); ServeError naming ``key`` if it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(f"{key}={port}: port {port} on {host} is already in use; pick another port "
                             "or 0 for a free one") from None
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _http_impl() -> str:
    try:
        import httptools  # noqa: F401
        return "httptools"
    except ImportError:
        return "h11"


def _loop_factory() -> Any:
    try:
        import uvloop
        return uvloop.new_event_loop
    except ImportError:
        return None


@dataclass
class ServerHandle:
    host: str
    port: int
    api_key: str | None
    sessions: SessionStore
    app: Any
    engine: Any
    _server: Any = field(repr=False, default=None)
    _thread: threading.Thread | None = field(repr=False, default=None)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return self.url + "/v1"

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.app.state.stats)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)


def start_server(engine: Any, *, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = "auto", fixed_sampling: bool = False, key: str = "serve.port",
                 log_level: str = "warning") -> ServerHandle:
    """Serve ``engine`` (``serve.engines``) on a thread; returns once it accepts connections.
    ``api_key``: "auto" makes a random one; None accepts any key (only for a loopback host)."""
    if api_key == "auto":
        api_key = f"sk-nemo-like-{secrets.token_urlsafe(24)}"
    if not _is_loopback(host):
        warnings.warn(f"serving on {host}, beyond this machine: anyone who can reach it and has the key can "
                      "use the model", stacklevel=2)
    sock = bind(host, port, key=key)
    sessions = SessionStore(api_key)
    app = build_app(engine, model_name=model_name, sessions=sessions, fixed_sampling=fixed_sampling)
    # httptools and uvloop (uvicorn[standard], as vLLM serves): h11's pure-Python parser and the
    # default loop took half the server's time per request on 2 cores.
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", access_log=False, http=_http_impl(),
                            timeout_keep_alive=30, limit_concurrency=4096)
    server = uvicorn.Server(config)

    def serve() -> None:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(server.serve(sockets=[sock]))
    thread = threading.Thread(target=serve, name="nemo-like-serve", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ServeError(f"the server on {host}:{sock.getsockname()[1]} did not start")
        time.sleep(0.01)
    return ServerHandle(host, sock.getsockname()[1], api_key, sessions, app, engine, server, thread)
