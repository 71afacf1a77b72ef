"""Running the HTTP app next to the engine: uvicorn on a socket bound at start-up, in a thread.

The socket is bound before the model loads, so a busy port fails at once (as
the control channel does), and handed to uvicorn, whose event loop runs in a
daemon thread while the engine keeps the main thread.
"""

from __future__ import annotations

import socket
import threading

from mlkit.serve import protocol as proto


def parse_http_address(addr: str) -> tuple[str, int]:
  """``--http``: "PORT" (on 127.0.0.1) or "HOST:PORT".

  Raises:
    ValueError: neither.
  """
  addr = str(addr)
  if addr.isdigit() and 0 < int(addr) < 65536:
    return "127.0.0.1", int(addr)
  return proto.parse_address(addr)


def bind(addr: str) -> socket.socket:
  """A listening TCP socket on ``--http``'s address.

  Raises:
    ValueError: a malformed address.
    OSError: naming the address when it is in use or cannot be bound.
  """
  host, port = parse_http_address(addr)
  try:
    return socket.create_server((host, port), backlog=2048, reuse_port=False)
  except OSError as e:
    raise OSError(e.errno, f"cannot serve HTTP on {host}:{port}: {e.strerror or e} "
                  "(is another server using this port?)") from None


class HttpServer:
  """uvicorn serving ``app`` on ``sock`` in a daemon thread.

  Args:
    app: the ASGI app (``mlkit.serve.http.app.build_app``).
    sock: a bound, listening socket (:func:`bind`).
  """

  def __init__(self, app, sock: socket.socket):
    import uvicorn
    self.sock = sock
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=30,
                            access_log=False, loop="uvloop", http="httptools")
    self.server = uvicorn.Server(config)
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                   daemon=True, name="http")

  @property
  def address(self) -> str:
    host, port = self.sock.getsockname()[:2]
    return f"{host}:{port}"

  def start(self) -> None:
    self.thread.start()

  def stop(self, timeout_s: float = 5.0) -> None:
    self.server.should_exit = True
    self.thread.join(timeout_s)
