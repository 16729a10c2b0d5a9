"""`strata serve`'s options (server.serve.add_serve adds them to the `strata` command; get_app parses their
defaults)."""
from hybrid.cli_options import add_device_options, add_setting, add_threads_and_context
from hybrid.cli_types import float_in, int_at_least, output_file, port

from .body import DEFAULT_MAX_BODY_BYTES, MIB

DEFAULT_MAX_CONNECTIONS = 100


def add_serve_options(p):
    add_setting(p, "model")
    add_setting(p, "parallel", metavar="N")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="port, 1..65535 (default 8080)")
    add_setting(p, "api_key", metavar="KEY")
    add_setting(p, "decode_share", metavar="F")
    add_setting(p, "max_queue", metavar="N")
    p.add_argument("--max-body-mib", type=float_in(0, low_open=True), default=DEFAULT_MAX_BODY_BYTES / MIB,
                   help=f"largest request body in MiB; a larger one is refused with 413 before it is read "
                        f"(default {DEFAULT_MAX_BODY_BYTES / MIB:g})")
    p.add_argument("--max-connections", type=int_at_least(1), default=None,
                   help=f"client connections open at once: each holds a file descriptor and buffers, so slow or "
                        f"idle clients cannot exhaust them; more wait in the OS's accept queue (default "
                        f"{DEFAULT_MAX_CONNECTIONS}, waitress's own, or --parallel + --max-queue when that is more: "
                        f"every admitted request holds one)")
    add_threads_and_context(p, "context limit per slot (default: the model's)")
    add_device_options(p)
    _add_conversation_options(p)
    p.add_argument("--profile-out", type=output_file, default=None,
                   help="on shutdown, save the expert usage seen while serving as an ExpertProfile (.npz; merged "
                        "into the file if it exists)")


def _add_conversation_options(p):
    g = p.add_argument_group("conversation cache (finished conversations kept so that they are not read again)")
    g.add_argument("--conversation-cache-mib", type=int_at_least(0), default=2048,
                   help="RAM for parked conversations in MiB, 0 turns the cache off (default 2048)")
    g.add_argument("--conversation-cache-slots", type=int_at_least(1), default=None,
                   help="most conversations kept (default: no limit, only the MiB budget evicts)")
    g.add_argument("--conversation-cache-kv", choices=["f32", "f16", "int8"], default="f32",
                   help="how parked KV is stored: f32 as read (exact, default), f16 (half the bytes, ~1e-3 off), "
                        "int8 (a quarter, ~1e-2 off)")
    g.add_argument("--conversation-cache-dir", default=None,
                   help="also keep parked conversations in this folder so that they survive a restart")


def conversation_options(args):
    return {"mib": args.conversation_cache_mib, "max_entries": args.conversation_cache_slots,
            "store": args.conversation_cache_kv, "spill_dir": args.conversation_cache_dir}
