"""`strata serve`: bind the port, load the model, start the engine thread, then serve the app in-process."""
import argparse
import errno
import logging
import os
import signal
import socket

from hybrid.cli_options import config_of, llm_objects
from hybrid.config import EngineConfig

from .routes import create_app
from .body import DEFAULT_MAX_BODY_BYTES, MIB
from .options import DEFAULT_MAX_CONNECTIONS, add_serve_options, conversation_options

log = logging.getLogger(__name__)

QUEUE_PER_SLOT = 16  # default --max-queue per slot
LISTEN_BACKLOG = 1024  # waitress's default
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def model_id(llm):
    from hybrid.demo import DEMO_NAME

    if DEMO_NAME in os.path.basename(llm.weights.source):
        return DEMO_NAME, "built-in demo model with RANDOM weights: its text is gibberish by construction"
    name = os.path.basename(os.path.normpath(llm.weights.source))
    return (name[: -len(".gguf")] if name.endswith(".gguf") else name), f"{llm.config.arch} ({name})"


def log_budget(llm, parallel, max_queue):
    model_bytes = sum(t.raw.nbytes for t in llm.weights.tensors.values())
    copied = sum(t.raw.nbytes for t in llm.weights.tensors.values() if t.raw.flags.writeable)
    held = "in RAM" if copied == model_bytes else "mapped from the file" if not copied else "partly in RAM"
    state = llm.model.recurrent_shape  # linear-attention layers: a fixed state per slot beside the KV
    state_text = "" if state is None else f" + recurrent state and its snapshot {state.slot_bytes / MIB:.1f} MiB"
    log.info("memory: model %.1f MiB (%s); %s (blocks taken as used)%s x %d slots; queue limit %d requests",
             model_bytes / MIB, held, llm.model.backend.describe_kv(llm.model.kv_pool, llm.max_context), state_text,
             parallel, max_queue)


def conversation_cache(llm, options):
    """The conversation cache the options ask for (server.options.conversation_options), or None when off."""
    from hybrid.conversation_cache import ConversationCache, model_fingerprint
    from hybrid.kv_store import bytes_per_token

    if not options or options["mib"] <= 0:
        return None
    c = llm.config
    per_token = bytes_per_token(llm.model.num_kv_layers, c.num_kv_heads, c.head_dim, options["store"])
    cache = ConversationCache(options["mib"] * MIB, model_fingerprint(llm.weights), max_entries=options["max_entries"],
                              store=options["store"], spill_dir=options["spill_dir"],
                              checkpoint_tokens=options.get("checkpoint_tokens", 1024))
    limit = options["max_entries"]
    log.info("conversation cache: %d MiB of %s KV (%.1f KiB per token: %d tokens), %s, %s", options["mib"],
             options["store"], per_token / 1024, options["mib"] * MIB // per_token,
             f"at most {limit} conversations" if limit else "no conversation limit",
             f"spilled to {options['spill_dir']}" if options["spill_dir"] else "RAM only")
    return cache


def build(config=None, llm_options=None, conversations=None, max_body_bytes=DEFAULT_MAX_BODY_BYTES):
    """The app over a started engine for `config` (hybrid/config.py: the model, parallel, max_queue,
    decode_share and api_key with the engine's settings; default: the environment's).
    llm_options: LLM's keywords that are not settings (placement, profile, dynamic).
    conversations: conversation cache options (server.options.conversation_options); default off.
    max_body_bytes: a larger request body is refused (413) before it is read."""
    from hybrid.engine import Engine
    from hybrid.llm import LLM
    from hybrid.speculative import SpecSettings

    config = config or EngineConfig.resolve()
    max_queue = queue_limit(config)
    llm = LLM(config=config.with_settings(kv_sequences=config.parallel), **(llm_options or {}))
    name, description = model_id(llm)
    if config.model is None:
        log.warning("serving the built-in demo model '%s': RANDOM weights, not a language model", name)
    log_budget(llm, config.parallel, max_queue)
    log.info("kernels ready in %.1f s (compiled on a first run, else loaded from Numba's cache)", llm.warm_up())
    engine = Engine(llm, num_slots=config.parallel, max_queue=max_queue, decode_share=config.decode_share,
                    conversation_cache=conversation_cache(llm, conversations),
                    speculation=SpecSettings.of(config)).start()
    log.info("engine: %d slots, decode share %.2f, up to %d %s drafts per step", config.parallel,
             config.decode_share, config.spec, "MTP" if engine.mtp is not None else "n-gram")
    return create_app(engine, name, api_key=config.api_key, description=description,
                      max_body_bytes=max_body_bytes), engine


def save_profile(engine, llm_weights, path):
    """The expert usage seen while serving, merged into `path` when it already holds a profile."""
    from placement.profile import ExpertProfile, model_id as profile_model_id

    profile = engine.usage.to_profile(profile_model_id(llm_weights), source="serve")
    if os.path.exists(path):
        profile = ExpertProfile.load(path).merge(profile)
    profile.save(path)
    log.info("expert profile (%d prefill + %d decode tokens) saved to %s", profile.tokens_prefill,
             profile.tokens_decode, path)


def build_from_args(args, config):
    """The app and engine of parsed `strata serve` arguments (server.options) and their config, for `run` and
    `get_app` alike."""
    if config.conversation_cache_dir:  # an unusable folder fails here, before the model loads
        os.makedirs(config.conversation_cache_dir, exist_ok=True)
    return build(config, llm_objects(args, config), conversation_options(config), max_body_bytes(config))


def max_body_bytes(config):
    return round(config.max_body_mib * MIB)


def app_from_environment():
    """get_app's app: `strata serve`'s defaults, with the settings of the STRATA_* environment."""
    parser = argparse.ArgumentParser(prog="get_app")
    add_serve_options(parser)
    args = parser.parse_args([])
    config = config_of(args)
    if not config.api_key:
        log.warning("no STRATA_API_KEY: bind the WSGI server to this machine only (waitress-serve listens on "
                    "0.0.0.0 unless given --listen 127.0.0.1:8080); anyone who can reach it can use the model")
    return build_from_args(args, config)[0]


def listen_socket(host, port):
    """A socket listening on host:port. Bound before the model loads, so that a taken port fails in one line
    before minutes of loading; ValueError naming the port when the OS refuses it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: not an address to listen on ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as waitress does: a restart need not wait
    try:
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is already in use") from None
        raise ValueError(f"cannot listen on port {port} of {host}: {exc.strerror}") from None
    return sock


def stop_on_sigterm():
    """SIGTERM (how services are stopped) shuts the server down as Ctrl-C does, so --profile-out is saved;
    a second SIGTERM during that shutdown ends the process at once."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.info("SIGTERM: shutting down")
        raise SystemExit(0)  # serve_http returns on SystemExit as on KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def warn_exposure(host, api_key):
    if host not in LOCAL_HOSTS and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)


def queue_limit(config):
    return config.max_queue or QUEUE_PER_SLOT * config.parallel


def connection_limit(config, max_connections=None):
    """--max-connections, by default 100 or the requests --parallel and --max-queue admit when more."""
    admitted = config.parallel + queue_limit(config)
    if max_connections is None:
        return max(DEFAULT_MAX_CONNECTIONS, admitted)
    if max_connections < admitted:
        log.warning("--max-connections %d is below the %d requests that --parallel and --max-queue admit: the "
                    "rest wait for a connection instead of getting 429", max_connections, admitted)
    return max_connections


def add_serve(sub):
    """The `serve` subcommand of the `strata` subparsers."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the demo model when no --model is given)")
    add_serve_options(p)
    p.set_defaults(func=run)


def run(args):
    """Serve until SIGINT or SIGTERM (the `strata serve` subcommand)."""
    from .http import serve_http

    config = config_of(args)
    with listen_socket(config.host, config.port) as sock:
        warn_exposure(config.host, config.api_key)
        max_connections = connection_limit(config, config.max_connections)
        app, engine = build_from_args(args, config)
        host = f"[{config.host}]" if ":" in config.host else config.host
        log.info("serving on http://%s:%d/v1", host, config.port)
        stop_on_sigterm()
        try:
            serve_http(app, [sock], parallel=config.parallel, max_queue=queue_limit(config),
                       max_connections=max_connections, max_body_bytes=max_body_bytes(config))
        finally:
            engine.stop()
            if config.profile_out:
                save_profile(engine, engine.model.weights, config.profile_out)
            engine.model.close()
    return 0
