"""`strata serve`: load the model, start the engine thread, then serve the app in-process with waitress."""
import logging
import os

from hybrid.scheduler import DEFAULT_DECODE_SHARE

from .app import create_app

log = logging.getLogger(__name__)

MIB = 1 << 20


def model_id(llm):
    from hybrid.demo import DEMO_NAME

    if DEMO_NAME in os.path.basename(llm.weights.source):
        return DEMO_NAME, "built-in demo model with RANDOM weights: its text is gibberish by construction"
    name = os.path.basename(os.path.normpath(llm.weights.source))
    return (name[: -len(".gguf")] if name.endswith(".gguf") else name), f"{llm.config.arch} from {llm.weights.source}"


def log_budget(llm, parallel, max_queue):
    model_bytes = sum(t.raw.nbytes for t in llm.weights.tensors.values())
    copied = sum(t.raw.nbytes for t in llm.weights.tensors.values() if t.raw.flags.writeable)
    held = "in RAM" if copied == model_bytes else "mapped from the file" if not copied else "partly in RAM"
    log.info("memory: model %.1f MiB (%s); %s (blocks taken as used) x %d slots; queue limit %d requests",
             model_bytes / MIB, held, llm.model.backend.describe_kv(llm.model.kv_pool, llm.max_context), parallel,
             max_queue)


def conversation_cache(llm, options):
    """The conversation cache the options ask for (hybrid.cli.conversation_options), or None when off."""
    from hybrid.conversation_cache import ConversationCache, model_fingerprint
    from hybrid.kv_store import bytes_per_token

    if not options or options["mib"] <= 0:
        return None
    c = llm.config
    per_token = bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, options["store"])
    cache = ConversationCache(options["mib"] * MIB, model_fingerprint(llm.weights), max_entries=options["max_entries"],
                              store=options["store"], spill_dir=options["spill_dir"])
    limit = options["max_entries"]
    log.info("conversation cache: %d MiB of %s KV (%.1f KiB per token: %d tokens), %s, %s", options["mib"],
             options["store"], per_token / 1024, options["mib"] * MIB // per_token,
             f"at most {limit} conversations" if limit else "no conversation limit",
             f"spilled to {options['spill_dir']}" if options["spill_dir"] else "RAM only")
    return cache


def build(model=None, parallel=1, api_key=None, decode_share=None, threads=None, max_context=None, max_queue=None,
          device_options=None, conversations=None):
    """The app over a started engine; unset options come from STRATA_* variables, then defaults.
    device_options: LLM's device keywords (device, expert_cache_mib, vram_reserve_mib, placement, profile,
    expert_cache); default the CPU.
    conversations: conversation cache options (hybrid.cli.conversation_options); default off."""
    from hybrid.engine import Engine
    from hybrid.llm import LLM

    if decode_share is None:
        decode_share = float(os.environ.get("STRATA_BATCH_DECODE_SHARE", DEFAULT_DECODE_SHARE))
    max_queue = max_queue or 16 * parallel
    llm = LLM(model, threads=threads, max_context=max_context, kv_sequences=parallel,
              **(device_options or {"device": "cpu"}))
    name, description = model_id(llm)
    if model is None:
        log.warning("serving the built-in demo model '%s': RANDOM weights, not a language model", name)
    log_budget(llm, parallel, max_queue)
    log.info("kernels ready in %.1f s (compiled on a first run, else loaded from Numba's cache)", llm.warm_up())
    engine = Engine(llm, num_slots=parallel, max_queue=max_queue, decode_share=decode_share,
                    conversation_cache=conversation_cache(llm, conversations)).start()
    log.info("engine: %d slots, decode share %.2f", parallel, decode_share)
    return create_app(engine, name, api_key=api_key, description=description), engine


def save_profile(engine, llm_weights, path):
    """The expert usage seen while serving, merged into `path` when it already holds a profile."""
    from placement.profile import ExpertProfile, model_id as profile_model_id

    profile = engine.usage.to_profile(profile_model_id(llm_weights), source="serve")
    if os.path.exists(path):
        profile = ExpertProfile.load(path).merge(profile)
    profile.save(path)
    log.info("expert profile (%d prefill + %d decode tokens) saved to %s", profile.tokens_prefill,
             profile.tokens_decode, path)


def run(args):
    """Serve until interrupted (the `strata serve` subcommand)."""
    import waitress

    from hybrid.cli import conversation_options, device_options

    app, engine = build(args.model, args.parallel, args.api_key or os.environ.get("STRATA_API_KEY"),
                        args.decode_share, args.threads, args.max_context, args.max_queue, device_options(args),
                        conversation_options(args))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    log.info("serving on http://%s:%d/v1", args.host, args.port)
    try:
        waitress.serve(app, host=args.host, port=args.port, threads=2 * args.parallel + 4,
                       channel_request_lookahead=4, ident="strata", clear_untrusted_proxy_headers=True)
    finally:
        engine.stop()
        if args.profile_out:
            save_profile(engine, engine.model.weights, args.profile_out)
        engine.model.close()
    return 0
