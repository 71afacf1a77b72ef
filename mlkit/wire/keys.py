"""Where the shared key of the serving processes comes from: never a constant in the source.

Every socket between the serving processes (:mod:`mlkit.wire.frames`) needs
the same key on both ends. It comes from, in order:

1. the environment, ``MLKIT_SERVE_AUTHKEY`` (the key's text);
2. a key file: ``--authkey-file PATH``, else ``MLKIT_SERVE_AUTHKEY_FILE``,
   else ``$XDG_RUNTIME_DIR/mlkit/serve.key`` (``~/.cache/mlkit/serve.key``
   without it). A key file must belong to this user and be closed to everyone
   else (mode 0600), or it is refused.

A server whose every address is loopback (127.0.0.0/8, ::1, ``localhost``)
and that finds no key generates one: 32 random bytes in hex, written with
mode 0600 to the key file, where the other roles and the client on this
machine find it. A server with any other address refuses to start without a
key given through the environment or an existing key file, and says how to
make one. docs/wire.md has the commands.

Imports no JAX.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import socket
import stat

from mlkit.wire.frames import MIN_KEY_BYTES

ENV_KEY = "MLKIT_SERVE_AUTHKEY"
ENV_KEY_FILE = "MLKIT_SERVE_AUTHKEY_FILE"
HOW_TO_MAKE = ("make one with `python -c 'import secrets; print(secrets.token_hex(32))' > "
               "serve.key && chmod 600 serve.key` and copy it to every host")


class AuthKeyError(ValueError):
  """No usable key: none given where one is required, or a key file that is not safe."""


@dataclasses.dataclass(frozen=True)
class Key:
  """A resolved key.

  Attributes:
    value: the key bytes.
    source: where it came from, in words (for the start-up log; never the key itself).
    path: the key file, when it came from one.
    generated: whether this process generated it just now.
  """

  value: bytes
  source: str
  path: str | None = None
  generated: bool = False

  def __repr__(self) -> str:  # never print the key
    return f"Key(source={self.source!r}, path={self.path!r}, generated={self.generated})"


def default_key_file(env=None) -> str:
  """The key file used when none is named: MLKIT_SERVE_AUTHKEY_FILE, else
  $XDG_RUNTIME_DIR/mlkit/serve.key, else ~/.cache/mlkit/serve.key."""
  env = os.environ if env is None else env
  if env.get(ENV_KEY_FILE):
    return os.path.abspath(os.path.expanduser(env[ENV_KEY_FILE]))
  base = env.get("XDG_RUNTIME_DIR") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mlkit", "serve.key")


def is_loopback(host: str) -> bool:
  """Whether every address ``host`` names is a loopback address (unresolvable: False)."""
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    pass
  try:
    infos = socket.getaddrinfo(host, None)
  except OSError:
    return False
  return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def _from_text(text: str, where: str) -> bytes:
  key = text.strip().encode()
  if len(key) < MIN_KEY_BYTES:
    raise AuthKeyError(f"the key in {where} is {len(key)} bytes; at least {MIN_KEY_BYTES} are "
                    f"needed ({HOW_TO_MAKE})")
  return key


def read_key_file(path: str) -> bytes:
  """The key in a key file, after checking the file is this user's and closed to others.

  Raises:
    AuthKeyError: the file is missing, not a regular file, another user's, open to
      others, or holds too short a key.
  """
  try:
    st = os.stat(path)
  except FileNotFoundError:
    raise AuthKeyError(f"key file {path} does not exist ({HOW_TO_MAKE})") from None
  if not stat.S_ISREG(st.st_mode):
    raise AuthKeyError(f"key file {path} is not a regular file")
  if st.st_uid != os.getuid():
    raise AuthKeyError(f"key file {path} belongs to another user (uid {st.st_uid})")
  if st.st_mode & 0o077:
    raise AuthKeyError(f"key file {path} is open to other users (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`")
  with open(path) as f:
    return _from_text(f.read(), f"key file {path}")


def generate_key_file(path: str) -> bytes:
  """Writes a fresh random key to ``path`` (mode 0600) unless a key file is already there.

  Two processes starting at once agree: the file appears whole or not at all
  (written aside, then hard-linked into place), and the one that loses reads
  the winner's key.

  Returns:
    The key in the file.
  """
  os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
  tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  try:
    with os.fdopen(fd, "w") as f:
      f.write(secrets.token_hex(32) + "\n")
      f.flush()
      os.fsync(f.fileno())
    try:
      os.link(tmp, path)
    except FileExistsError:
      pass  # another process made it first: use theirs
  finally:
    os.unlink(tmp)
  return read_key_file(path)


def server_key(hosts, key_file: str | None = None, env=None) -> Key:
  """The key a server uses, generated when it may be.

  Args:
    hosts: every host this process listens on or connects to with the key.
    key_file: the key file the user named (``--authkey-file``), or None.
    env: the environment (default ``os.environ``).

  Raises:
    AuthKeyError: a non-loopback host and no key given (the message says how to
      give one), or a key file that cannot be used.
  """
  env = os.environ if env is None else env
  if env.get(ENV_KEY):
    return Key(_from_text(env[ENV_KEY], ENV_KEY), f"the environment ({ENV_KEY})")
  public = [h for h in hosts if not is_loopback(h)]
  if key_file is not None:
    path = os.path.abspath(os.path.expanduser(key_file))
    if os.path.exists(path) or public:
      return Key(read_key_file(path), f"key file {path}", path)
    return Key(generate_key_file(path), f"key file {path} (generated)", path, True)
  if public:
    raise AuthKeyError(
        f"{public[0]} is not a loopback address, so the serving channels need a key shared by "
        f"every process: set {ENV_KEY} or pass --authkey-file PATH ({HOW_TO_MAKE})")
  path = default_key_file(env)
  if os.path.exists(path):
    return Key(read_key_file(path), f"key file {path}", path)
  return Key(generate_key_file(path), f"key file {path} (generated)", path, True)


def client_key(key: bytes | str | None = None, key_file: str | None = None, env=None) -> bytes:
  """The key a client uses: ``key`` itself, else MLKIT_SERVE_AUTHKEY, else the key file
  (``key_file`` or the default one, which a server on this machine generated).

  Raises:
    AuthKeyError: no key anywhere (the message names the file it looked for).
  """
  env = os.environ if env is None else env
  if key is not None:
    return _from_text(key.decode() if isinstance(key, bytes) else key, "the key given")
  if env.get(ENV_KEY):
    return _from_text(env[ENV_KEY], ENV_KEY)
  path = (os.path.abspath(os.path.expanduser(key_file)) if key_file is not None
          else default_key_file(env))
  if not os.path.exists(path):
    raise AuthKeyError(f"no key: {ENV_KEY} is not set and key file {path} does not exist (a "
                    "server on loopback writes it at start-up and prints its path; or pass "
                    "--authkey-file)")
  return read_key_file(path)
