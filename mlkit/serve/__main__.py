"""``python -m mlkit.serve --role prefill|decode|colocated ...``: one serving process.

Start a prefill server, then a decode server pointing at it; clients talk to
the decode server (``python -m mlkit.serve.client``). docs/serving_processes.md
has the commands for a pair on one machine.

Start-up checks come before the slow parts, so a mistake fails in a second:
the arguments, then the listening port, then the checkpoint path; a decode
server then waits at most ``--connect-timeout`` for its prefill server.
Exit status 2 for a bad start (the message says what to fix), 0 after a
``shutdown`` message or Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

PROG = "python -m mlkit.serve"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog=PROG, description="A prefill, decode or colocated serving process (docs/serving_processes.md).",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--role", required=True, choices=("prefill", "decode", "colocated"),
                 help="prefill: runs prompts for decode servers; decode: the front door, with a "
                      "prefill server at --prefill; colocated: one engine does both")
  p.add_argument("--listen", default=None,
                 help="HOST:PORT of the control channel (default 127.0.0.1:7100 for prefill, "
                      "127.0.0.1:7200 otherwise)")
  p.add_argument("--prefill", default=None, help="decode: HOST:PORT of the prefill server")
  p.add_argument("--transfer-host", default="127.0.0.1",
                 help="host the KV transfer server binds (its port is picked freely and sent to "
                      "the peer at hello)")
  src = p.add_mutually_exclusive_group(required=True)
  src.add_argument("--checkpoint", help="an orbax (mlkit.checkpoint) or Hugging Face checkpoint "
                                        "directory")
  src.add_argument("--model", help="a preset from configs.models with random params (demos, tests)")
  p.add_argument("--seed", type=int, default=0, help="--model: the params' random seed")
  p.add_argument("--n-layers", type=int, default=None,
                 help="--model: keep the first N layers (faster compiles for demos)")
  p.add_argument("--recipe", default="bf16", help="weight recipe (mlkit.quant.RECIPES)")
  p.add_argument("--kv-dtype", default="float32", choices=("float32", "bfloat16", "float8_e4m3fn"))
  p.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default: the model's)")
  p.add_argument("--num-pages", type=int, default=64)
  p.add_argument("--max-running", type=int, default=4)
  p.add_argument("--max-pages-per-seq", type=int, default=16)
  p.add_argument("--prefill-chunk", type=int, default=16, help="prompt tokens per request per step")
  p.add_argument("--devices", type=int, default=1,
                 help="local devices of this process's pool (on a CPU: host devices made)")
  mh = p.add_argument_group("a pool over several processes (multi-host, jax.distributed)")
  mh.add_argument("--num-processes", type=int, default=1,
                  help="processes of this server's pool; > 1: process 0 serves (the leader), "
                       "the others repeat its device work (followers)")
  mh.add_argument("--process-id", type=int, default=0, help="this process's index in the pool")
  mh.add_argument("--coordinator", default=None,
                  help="HOST:PORT of jax.distributed's coordinator (process 0 binds it)")
  mh.add_argument("--pool-address", default=None,
                  help="HOST:PORT where the leader listens for its followers")
  p.add_argument("--authkey-file", default=None,
                 help="file holding the key every serving channel shares (mode 0600; the key "
                      "itself may come from env MLKIT_SERVE_AUTHKEY instead). On loopback "
                      "addresses a missing file is generated; other addresses need a key "
                      "(docs/wire.md). Default: MLKIT_SERVE_AUTHKEY_FILE, else "
                      "$XDG_RUNTIME_DIR/mlkit/serve.key or ~/.cache/mlkit/serve.key")
  # Refused with a message (a key on the command line is visible to every user in `ps`).
  p.add_argument("--authkey", default=None, help=argparse.SUPPRESS)
  p.add_argument("--connect-timeout", type=float, default=30.0,
                 help="decode: seconds to wait for the prefill server at start-up")
  p.add_argument("--prefill-timeout", type=float, default=60.0,
                 help="decode: seconds to wait for a prefill's answer before aborting (timeout)")
  p.add_argument("--pull-timeout", type=float, default=30.0, help="decode: seconds per KV pull")
  p.add_argument("--transfer-attempts", type=int, default=2,
                 help="decode: attempts per request before a checksum mismatch aborts it")
  p.add_argument("--offer-timeout", type=float, default=30.0,
                 help="prefill: free an offer's pages when the decode server has not released "
                      "it within this many seconds")
  p.add_argument("--no-warmup", dest="warmup", action="store_false",
                 help="skip compiling the steps on a dummy request at start-up")
  web = p.add_argument_group("the OpenAI-compatible HTTP API (decode and colocated roles; "
                             "docs/http.md)")
  web.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help="serve HTTP here (a bare PORT binds 127.0.0.1)")
  web.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(prefer env MLKIT_API_KEY or --api-key-file: a command line is "
                        "visible to every user in `ps`)")
  web.add_argument("--api-key-file", default=None, help="read the API key from this file")
  web.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: the preset, or the checkpoint "
                        "directory's name)")
  web.add_argument("--tokenizer", default=None,
                   help="a directory with the tokenizer files (default: the checkpoint's)")
  web.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait; beyond, HTTP answers 503 with Retry-After")
  p.add_argument("--arrival-gap-ms", type=float, default=None,
                 help="decode and colocated: after new requests arrive, wait this long for "
                      "more before stepping, so a burst prefills in one step (default 1; 0: "
                      "off; docs/http.md)")
  p.add_argument("--arrival-max-ms", type=float, default=None,
                 help="the longest a burst of arrivals holds a step (default 30)")
  p.add_argument("--batch-buckets", default=None, metavar="B1,B2,...",
                 help="batch sizes a step pads to, ascending, the last at least --max-running "
                      "(default: --max-running only: the fewest compiles)")
  p.add_argument("--overlap", action="store_true",
                 help="colocated: dispatch each step before collecting the last (host work, "
                      "HTTP included, runs while the device computes)")
  p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                 help="draft K tokens per request and step with the checkpoint's MTP layer and "
                      "verify them in one target pass (0: off; a disaggregated pair sets the "
                      "same K on both servers)")
  p.add_argument("--max-logprobs", type=int, default=20,
                 help="top log-probabilities each step computes (0: none)")
  p.add_argument("--enable-fault-injection", action="store_true",
                 help="accept test-only fault messages (prefill: corruption, a delayed offer; "
                      "decode: a delayed pull; decode and colocated: page faults)")
  return p


def _arrival_window(args):
  """--arrival-gap-ms / --arrival-max-ms as an ArrivalWindow (unset: its defaults)."""
  from mlkit.serve.arrival import ArrivalWindow  # no jax: checked before jax's import
  default = ArrivalWindow()
  gap = default.gap_s if args.arrival_gap_ms is None else args.arrival_gap_ms / 1e3
  most = default.max_s if args.arrival_max_ms is None else args.arrival_max_ms / 1e3
  try:
    return ArrivalWindow(gap, max(most, gap) if args.arrival_max_ms is None else most)
  except ValueError as e:
    raise ValueError(f"--arrival-gap-ms {args.arrival_gap_ms} / --arrival-max-ms "
                     f"{args.arrival_max_ms}: both must be >= 0, the max at least the gap") from e


def _fail(msg: str) -> None:
  print(f"{PROG}: error: {msg}", file=sys.stderr, flush=True)
  sys.exit(2)


def _log(msg: str) -> None:
  print(f"mlkit.serve: {msg}", file=sys.stderr, flush=True)


def _set_devices(n: int) -> None:
  """This process's host device count, before jax is imported (tests' XLA_FLAGS are overridden)."""
  flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  # Before anything imports jax: this process's devices, and the CPU on a machine without a GPU.
  _set_devices(max(1, args.devices))
  from pallas_kernels.h200 import env as h200_env
  h200_env.prepare(ptxas_report=False)
  from mlkit.serve import protocol as proto
  listen = args.listen or ("127.0.0.1:7100" if args.role == "prefill" else "127.0.0.1:7200")
  # The checks that need neither jax nor the model come first, so that a mistyped command
  # fails in a fraction of a second instead of after jax's import.
  if args.authkey is not None:
    _fail("--authkey is not taken: a key on the command line is visible to every user in "
          "`ps`; set MLKIT_SERVE_AUTHKEY or pass --authkey-file PATH")
  try:
    proto.parse_address(listen)
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      raise ValueError(f"--process-id {args.process_id} must be in [0, --num-processes "
                       f"{args.num_processes})")
    if args.num_processes > 1:
      if not (args.coordinator and args.pool_address):
        raise ValueError("--num-processes > 1 needs --coordinator HOST:PORT and "
                         "--pool-address HOST:PORT")
      proto.parse_address(args.coordinator)
      proto.parse_address(args.pool_address)
    if args.role == "decode":
      if not args.prefill:
        raise ValueError("--role decode needs --prefill HOST:PORT (the prefill server)")
      proto.parse_address(args.prefill)
    if args.http is not None and args.role == "prefill":
      raise ValueError("--http serves the decode and colocated roles (clients talk to the "
                       "decode server)")
    if args.max_waiting < 1:
      raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    window = _arrival_window(args)
    api_key = _api_key(args)
  except ValueError as e:
    _fail(str(e))
  from mlkit import wire
  hosts = [proto.parse_address(a)[0] for a in (listen, args.prefill, args.pool_address,
                                               args.coordinator) if a]
  try:  # the key of every channel: never a constant (mlkit.wire.keys)
    key = wire.server_key([*hosts, args.transfer_host], args.authkey_file)
  except (wire.AuthKeyError, OSError) as e:
    _fail(str(e))
  if args.checkpoint is not None and not os.path.isdir(args.checkpoint):
    _fail(f"checkpoint directory {os.path.abspath(args.checkpoint)} does not exist")
  from mlkit.serve.model import ServeConfig
  try:
    cfg = ServeConfig(role=args.role, checkpoint=args.checkpoint, model=args.model, seed=args.seed,
                      n_layers=args.n_layers, recipe=args.recipe, kv_dtype=args.kv_dtype,
                      page_size=args.page_size, num_pages=args.num_pages,
                      max_running=args.max_running, max_pages_per_seq=args.max_pages_per_seq,
                      prefill_chunk=args.prefill_chunk, devices=args.devices,
                      enable_fault_injection=args.enable_fault_injection,
                      max_logprobs=args.max_logprobs, overlap=args.overlap,
                      batch_buckets=_buckets(args.batch_buckets),
                      speculative_tokens=args.speculative_tokens)
    from mlkit.serve.decode import DecodeOptions
    options = DecodeOptions(prefill_timeout_s=args.prefill_timeout, pull_timeout_s=args.pull_timeout,
                            transfer_attempts=args.transfer_attempts)
  except ValueError as e:
    _fail(str(e))
  _log(f"key of the serving channels: {key.source}")
  if args.process_id > 0:  # a follower: no channels of its own, it repeats its leader's work
    return _follow(args, cfg, key.value)
  try:
    listener = proto.listen(listen, key.value)  # before the model: a busy port fails at once
  except OSError as e:
    _fail(str(e))
  _log(f"role {cfg.role}: control channel on {listen}")
  http_sock = None
  if args.http is not None and args.process_id == 0:
    from mlkit.serve.http.server import bind
    try:
      http_sock = bind(args.http)  # before the model too
    except (OSError, ValueError) as e:
      _fail(str(e))
  if cfg.role == "decode":  # an unreachable peer fails before the model is loaded
    try:
      proto.probe(args.prefill, args.connect_timeout)
    except ConnectionError as e:
      _fail(f"prefill server unreachable: {e}")

  import jax
  from jax.experimental import transfer

  engine, mcfg = _build(args, cfg)
  followers = None
  if args.num_processes > 1:
    from mlkit.engine import lockstep
    try:
      followers = lockstep.Followers(proto.parse_address(args.pool_address),
                                     args.num_processes - 1, key.value,
                                     timeout_s=args.connect_timeout)
    except (OSError, TimeoutError) as e:
      _fail(f"pool followers: {e}")
    engine.lead(followers)
    _log(f"leading a pool of {args.num_processes} processes ({len(jax.devices())} devices)")
  if cfg.role != "colocated":
    tserver = transfer.start_transfer_server(jax.local_devices()[0].client, f"{args.transfer_host}:0",
                                             [f"{args.transfer_host}:0"])
    _log(f"KV transfer server on {tserver.address()}")
  if cfg.role == "prefill":
    from mlkit.serve.prefill import PrefillServer
    server = PrefillServer(engine, listener, tserver, model_name=mcfg.name,
                           offer_timeout_s=args.offer_timeout,
                           enable_fault_injection=cfg.enable_fault_injection)
  elif cfg.role == "decode":
    from mlkit.serve.decode import DecodeServer
    server = DecodeServer(engine, listener, tserver, args.prefill, key=key.value,
                          model_name=mcfg.name, options=options, max_waiting=args.max_waiting,
                          arrival_window=window)
  else:
    from mlkit.serve.decode import ColocatedServer
    server = ColocatedServer(engine, listener, model_name=mcfg.name,
                             max_waiting=args.max_waiting, arrival_window=window)
  door = None
  if http_sock is not None:  # up during warm-up: /health answers 503 until it is done
    door = _start_http(args, cfg, server, engine, http_sock, api_key)
  if args.warmup:
    from mlkit.serve.model import warm_up
    if cfg.role == "colocated":
      from mlkit.serve.model import warm_up_colocated
      _log(f"warm-up (compiles every batch bucket) took {warm_up_colocated(engine):.1f} s")
    else:
      _log(f"warm-up (compiles) took {warm_up(engine):.1f} s")
  if cfg.role == "decode":
    try:
      server.connect_peer(args.connect_timeout)
      server.wait_peer(args.connect_timeout)
    except ConnectionError as e:
      _fail(f"prefill server unreachable: {e}")
    _log(f"connected to the prefill server at {args.prefill}")
  if door is not None:
    door.ready.set()
  _log(f"ready ({cfg.role} on {listen})")
  try:
    server.serve_forever()
  except KeyboardInterrupt:
    pass
  except Exception as e:
    if followers is None:
      raise
    # A pool over processes that lost a member (or whose SPMD step failed) cannot run
    # another step: leave at once, so that clients and the peer server see the
    # connections close and reclaim what they hold. No jax.distributed shutdown: it
    # would wait for the missing process.
    _log(f"error: the pool cannot go on: {type(e).__name__}: {e}")
    sys.stderr.flush()
    os._exit(3)
  finally:
    if followers is not None:  # they stop with their leader
      followers.close()
  _log("stopped")
  listener.close()
  return 0


def _buckets(text: str | None) -> tuple[int, ...] | None:
  if text is None:
    return None
  try:
    return tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise ValueError(f"--batch-buckets takes comma-separated ints, got {text!r}") from None


def _api_key(args) -> str | None:
  """The HTTP API key: --api-key-file, --api-key, or env MLKIT_API_KEY (None: no key).

  Raises:
    ValueError: an unreadable or empty key file.
  """
  if args.api_key_file is not None:
    try:
      with open(args.api_key_file) as f:
        key = f.read().strip()
    except OSError as e:
      raise ValueError(f"--api-key-file {args.api_key_file}: {e.strerror or e}") from None
    if not key:
      raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    return key
  return args.api_key or os.environ.get("MLKIT_API_KEY") or None


def _start_http(args, cfg, server, engine, sock, api_key):
  """Starts the OpenAI-compatible API on ``sock`` (health 503 until ``door.ready``)."""
  from absl import logging

  from mlkit import wire
  from mlkit.serve.http.app import Door, build_app
  from mlkit.serve.http.metrics import ServeMetrics
  from mlkit.serve.http.openai_api import Context
  from mlkit.serve.http.server import HttpServer
  from mlkit.text import TokenizerError, load_tokenizer
  source = args.tokenizer or cfg.checkpoint
  tokenizer = None
  if source is not None:
    try:
      tokenizer = load_tokenizer(source)
    except TokenizerError as e:
      _fail(f"cannot load the tokenizer: {e}")
  vocab = engine.config.model.vocab_size
  if tokenizer is None:
    _log("no tokenizer: the HTTP API takes token-id prompts only")
  else:
    _log(f"tokenizer from {source}: {tokenizer.vocab_size} tokens, eos {list(tokenizer.eos_token_ids)}"
         f", chat template {'yes' if tokenizer.chat_template else 'none'}")
    if tokenizer.vocab_size > vocab:
      logging.warning("the tokenizer has %d tokens, the model %d: prompts with ids past the "
                      "model's are refused", tokenizer.vocab_size, vocab)
  name = args.served_model_name or cfg.model_name
  metrics = ServeMetrics(name)
  server.serve_metrics = metrics
  door = Door(server.inbox.queue, Context(model=name, vocab_size=vocab,
                                          max_tokens=engine.config.max_seq_tokens,
                                          max_logprobs=engine.config.logprobs,
                                          tokenizer=tokenizer), metrics, api_key)
  http = HttpServer(build_app(door), sock)
  http.start()
  host = http.address.rsplit(":", 1)[0]
  if api_key is None and not wire.is_loopback(host):
    logging.warning("HTTP on %s without an API key: anyone who reaches it can use it "
                    "(set MLKIT_API_KEY or --api-key-file)", http.address)
  _log(f"HTTP (OpenAI-compatible) on http://{http.address} as model {name!r}"
       + (", API key required" if api_key else ""))
  return door


def _build(args, cfg):
  """Joins the pool's processes (when several), loads the model and builds the engine."""
  import jax
  from absl import logging

  from mlkit.serve.model import build_engine, load_model
  logging.set_verbosity(logging.WARNING)
  if args.num_processes > 1:
    from mlkit.parallel import initialize_distributed
    initialize_distributed(args.coordinator, args.num_processes, args.process_id,
                           initialization_timeout=int(args.connect_timeout))
  t0 = time.perf_counter()
  try:
    params, mcfg = load_model(cfg)
  except (OSError, ValueError) as e:
    _fail(f"cannot load the model: {e}")
  what = (f"checkpoint {cfg.checkpoint}" if cfg.checkpoint else
          f"preset {cfg.model} (random params, seed {cfg.seed})")
  _log(f"model {mcfg.name}: {mcfg.n_layers} layers, {what}, loaded in {time.perf_counter() - t0:.1f} s")
  try:
    engine = build_engine(cfg, params, mcfg)
  except ValueError as e:  # the engine refuses the configuration (e.g. K drafts, no MTP layer)
    _fail(f"cannot serve {mcfg.name} as configured: {e}")
  del params
  _log(f"pool: {cfg.num_pages} pages of {engine.config.page_size} tokens, KV "
       f"{engine.pool_layout()['kv_dtype']}, {len(jax.devices())} {jax.default_backend()} "
       "device(s), "
       f"max {cfg.max_running} running")
  # What was loaded, not what --recipe says: a quantised checkpoint keeps its formats.
  _log("weights: " + "; ".join(f"{g} {f}" for g, f in engine.weight_formats().items()))
  if engine.config.speculative_tokens:
    _log(f"speculative decoding: {engine.config.speculative_tokens} drafts per request and step "
         f"from the model's MTP layer (a request reserves {engine.config.lookahead} positions "
         "of look-ahead)")
  return engine, mcfg


def _follow(args, cfg, key: bytes) -> int:
  """A follower process: builds the same engine and repeats its leader's device work."""
  import jax
  from mlkit import wire
  from mlkit.serve import protocol as proto
  engine, _ = _build(args, cfg)
  _log(f"process {args.process_id} of {args.num_processes}: following the pool leader at "
       f"{args.pool_address}")
  try:
    ops, stopped = engine.follow(proto.parse_address(args.pool_address), key,
                                 connect_timeout_s=args.connect_timeout)
  except ConnectionError as e:
    _fail(f"pool leader unreachable: {e}")
  except wire.FrameError as e:  # nothing of it ran; the pool cannot go on without its leader
    _log(f"error: refused a frame from the pool leader: {e}")
    sys.stderr.flush()
    os._exit(1)
  if not stopped:  # the leader died: no coordinator to shut down with, so leave at once
    _log(f"the pool leader went away after {ops} pool operations")
    sys.stdout.flush()
    os._exit(1)
  _log(f"stopped after {ops} pool operations")
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
