"""A small client of a decode (or colocated) server, and ``python -m mlkit.serve.client``.

    from mlkit.serve.client import Client
    with Client("127.0.0.1:7200") as c:
      outs = c.generate([[1, 2, 3]], max_new_tokens=8)
      print(outs[0]["tokens"], outs[0]["finish_reason"] or outs[0]["abort_reason"])

Imports no JAX: a client process stays light.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from mlkit import wire
from mlkit.serve import protocol as proto


class ServerError(RuntimeError):
  """The server refused a message (its reason is the text)."""


class Client:
  """One control connection to a server.

  Args:
    address: HOST:PORT of the decode or colocated server (or a prefill server,
      for ``fault``/``metrics``).
    key: the shared key; default: ``MLKIT_SERVE_AUTHKEY``, else the key file
      (``key_file``, else the default one a server on this machine wrote).
    key_file: where to read the key when ``key`` and the environment give none.
    timeout_s: how long to wait for the server to accept, and for each answer.

  Raises:
    ConnectionError: no server reachable within ``timeout_s``, or it refused the
      key (``mlkit.wire.AuthenticationError``).
    mlkit.wire.AuthKeyError: no key anywhere.
  """

  def __init__(self, address: str, *, key: bytes | str | None = None,
               key_file: str | None = None, timeout_s: float = 30.0):
    self.address = address
    self.timeout_s = timeout_s
    self._conn = proto.connect(address, wire.client_key(key, key_file), timeout_s)
    self._kinds = proto.reply_kinds()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self) -> None:
    self._conn.close()

  def request(self, kind: str, timeout_s: float | None = None, **fields) -> dict:
    """Sends one message and returns the answer (checked against its kind's schema).

    Raises:
      TimeoutError: no answer within the timeout.
      ConnectionError: the server closed the connection.
      ServerError: the server answered with an error.
      mlkit.wire.FrameError: the answer is not a well-formed message.
    """
    self._conn.send(proto.message(kind, **fields))
    timeout = self.timeout_s if timeout_s is None else timeout_s
    if not self._conn.poll(timeout):
      raise TimeoutError(f"no answer to {kind!r} from {self.address} within {timeout:g} s")
    try:
      reply = self._conn.recv(self._kinds)
    except EOFError as e:
      raise ConnectionError(f"{self.address} closed the connection ({e})") from None
    if reply["kind"] == "error":
      raise ServerError(reply["error"])
    return reply

  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16,
               temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
               stop_tokens: Sequence[int] = (), sampling: Sequence[dict] | None = None,
               batch: int | None = None, timeout_s: float | None = None) -> list[dict]:
    """Generates from every prompt; returns one dict per prompt, in order.

    Each dict: ``tokens``, ``status`` ("finished" or "aborted"), ``finish_reason``,
    ``abort_reason`` (e.g. "transfer", "peer_lost", "timeout", "cancelled"),
    ``error``, ``ttft_s`` and ``latency_s`` (server-side).

    Args:
      sampling: per-prompt SamplingParams fields, overriding the keyword values.
      batch: an id for this call (an int in [0, 2**63)) by which :meth:`cancel`, from
        any connection, ends its unfinished requests.

    Raises:
      ServerError: an invalid request (nothing was queued); as :meth:`request`.
    """
    base = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                seed=seed, stop_tokens=list(stop_tokens))
    per = [dict(base, **(sampling[i] if sampling else {})) for i in range(len(prompts))]
    extra = {} if batch is None else {"batch": int(batch)}
    reply = self.request("generate", timeout_s, prompts=[[int(t) for t in p] for p in prompts],
                         sampling=per, **extra)
    if reply["kind"] != "result":
      raise ServerError(f"expected a result, got {reply['kind']!r}")
    return reply["outputs"]

  def cancel(self, batch: int) -> int:
    """Cancels the unfinished requests of the generate call with id ``batch``; returns how many."""
    return self.request("cancel", batch=int(batch)).get("cancelled", 0)

  def metrics(self) -> dict:
    return self.request("metrics")["metrics"]

  def shutdown(self) -> None:
    self.request("shutdown")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mlkit.serve.client",
                              description="Sends one generate request to a decode or colocated "
                                          "server and prints the result as JSON.")
  p.add_argument("--server", default="127.0.0.1:7200", help="HOST:PORT of the server")
  p.add_argument("--prompt", action="append", required=True,
                 help="token ids, comma-separated (repeat for a batch)")
  p.add_argument("--max-new-tokens", type=int, default=16)
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--timeout", type=float, default=120.0)
  p.add_argument("--authkey-file", default=None,
                 help="the key file (default: MLKIT_SERVE_AUTHKEY, else the file a server on "
                      "this machine wrote, printed at its start-up)")
  args = p.parse_args(argv)
  try:
    prompts = [[int(t) for t in s.split(",") if t.strip()] for s in args.prompt]
  except ValueError:
    p.error("--prompt takes comma-separated integer token ids, e.g. --prompt 1,2,3")
  try:
    with Client(args.server, key_file=args.authkey_file, timeout_s=args.timeout) as c:
      outs = c.generate(prompts, max_new_tokens=args.max_new_tokens,
                        temperature=args.temperature, seed=args.seed)
  except (ConnectionError, TimeoutError, ServerError, wire.AuthKeyError, wire.FrameError) as e:
    print(f"python -m mlkit.serve.client: error: {e}", file=sys.stderr)
    return 1
  print(json.dumps(outs, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
