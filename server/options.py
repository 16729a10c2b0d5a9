"""`strata serve`'s options (server.serve.add_serve adds them to the `strata` command; get_app parses their
defaults): the settings of hybrid/config.py whose commands include serve."""
from hybrid.cli_options import add_settings
from hybrid.config import DEFAULT_MAX_CONNECTIONS  # noqa: F401  (server.serve's default)


def add_serve_options(p):
    add_settings(p, "serve")


def conversation_options(config):
    """The conversation cache options of an EngineConfig (server.serve.conversation_cache)."""
    return {"mib": config.conversation_cache_mib, "max_entries": config.conversation_cache_slots,
            "store": config.conversation_cache_kv, "spill_dir": config.conversation_cache_dir,
            "checkpoint_tokens": config.conversation_checkpoint_tokens}
