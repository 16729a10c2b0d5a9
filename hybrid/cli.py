"""The `strata` command line."""
import argparse
import json
import logging
import sys

from .cli_types import existing_file, float_in, int_at_least, output_file, port, token_ids

DEFAULT_MAX_CONNECTIONS = 100


def _cache_mib(text):
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or 'auto', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


DYNAMIC_FLAGS = {"decay": float, "margin": float, "min_score": float, "max_swaps": int, "max_pending": int}


def _dynamic_value(field, kind):
    """argparse type of --dynamic-FIELD: a `kind` within placement.dynamic.SETTING_LIMITS."""
    from placement.dynamic import SETTING_LIMITS

    valid, what = SETTING_LIMITS[field]

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


def _add_dynamic_options(p):
    from placement.dynamic import DynamicSettings

    g = p.add_argument_group("dynamic expert cache (with --expert-cache dynamic; placement/dynamic.py)")
    helps = {"decay": "per-step decay of an expert's usage score, in (0, 1]",
             "margin": "hysteresis: a newcomer's score must exceed (1 + MARGIN) x the evicted expert's ...",
             "min_score": "... plus this many (decayed) routings",
             "max_swaps": "swaps started per step, over all layers",
             "max_pending": "swaps in flight at once (pinned staging buffers)"}
    for field, kind in DYNAMIC_FLAGS.items():
        flag = "--dynamic-" + field.replace("_", "-")
        g.add_argument(flag, dest=f"dynamic_{field}", type=_dynamic_value(field, kind), default=None,
                       metavar=field.upper(),
                       help=f"{helps[field]} (default {getattr(DynamicSettings, field)})")


def dynamic_settings(args):
    """The DynamicSettings of the --dynamic-* flags (None when none is given); ValueError when one is
    given without --expert-cache dynamic."""
    from placement.dynamic import DynamicSettings

    given = {f: getattr(args, f"dynamic_{f}") for f in DYNAMIC_FLAGS if getattr(args, f"dynamic_{f}") is not None}
    if not given:
        return None
    if args.expert_cache != "dynamic":
        flags = ", ".join("--dynamic-" + f.replace("_", "-") for f in given)
        raise ValueError(f"{flags}: only with --expert-cache dynamic (got --expert-cache {args.expert_cache})")
    return DynamicSettings(**given)


def _add_device_options(p):
    from .backends import DEVICES
    from .backends.gpu import DEFAULT_RESERVE_MIB, KV_HOST_ATTENTION
    from .kv_store import KV_DTYPES
    from .residency import EXPERT_CACHE_MODES

    p.add_argument("--kv", choices=KV_DTYPES, default="f32",
                   help="KV cache encoding: f32 (exact, default), f16 / bf16 (half the bytes, ~1e-3 / ~1e-2 off), "
                        "int8 with per-token, per-head scales (a quarter, ~1e-2 off)")
    p.add_argument("--kv-resident", type=int_at_least(1), default=None, metavar="N",
                   help="GPU: keep only the newest N tokens of each slot's KV in VRAM (rounded up to 64-token "
                        "blocks), the older ones in pinned RAM (default: all in VRAM)")
    p.add_argument("--kv-host-attention", choices=KV_HOST_ATTENTION, default="gpu",
                   help="with --kv-resident: who attends the KV in RAM: gpu (copied to VRAM layer by layer; "
                        "default, faster over PCIe 5) or cpu (the host, while the GPU attends the VRAM part)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the model runs: auto (the GPU when usable, else the CPU), gpu, cpu (default auto)")
    p.add_argument("--expert-cache-mib", type=_cache_mib, default=None, metavar="N|auto",
                   help="VRAM for resident experts (default auto: all that is left)")
    p.add_argument("--vram-reserve-mib", type=float_in(0), default=DEFAULT_RESERVE_MIB, metavar="N",
                   help=f"VRAM left free as headroom (default {DEFAULT_RESERVE_MIB})")
    p.add_argument("--placement", type=existing_file, default=None, metavar="FILE",
                   help="resident experts from `strata plan` (placement.json); refused if it does not fit")
    p.add_argument("--expert-cache", choices=EXPERT_CACHE_MODES, default="auto",
                   help="auto: the experts of --placement, or planned at start-up from --profile for the VRAM "
                        "left, or without either the cache filled layer by layer; dynamic: start the same way "
                        "(without either, the same count in every layer) and swap experts in the background "
                        "as usage changes (default auto)")
    p.add_argument("--profile", type=existing_file, default=None, metavar="P.npz",
                   help="expert profile (`strata profile`) to plan the expert cache from at start-up")
    p.add_argument("--no-prefill-borrow", dest="prefill_borrow", action="store_false",
                   help="never copy non-resident experts to the GPU for large prompt chunks (prefill borrow)")
    _add_dynamic_options(p)


def device_options(args):
    """The LLM keyword arguments of the device options."""
    return dict(device=args.device, expert_cache_mib=args.expert_cache_mib, vram_reserve_mib=args.vram_reserve_mib,
                placement=args.placement, profile=args.profile, expert_cache=args.expert_cache,
                dynamic=dynamic_settings(args), prefill_borrow=args.prefill_borrow, kv=args.kv,
                kv_resident=args.kv_resident, kv_host_attention=args.kv_host_attention)


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a prompt (the demo model when no --model is given)")
    p.add_argument("--model", help="GGUF file or HF safetensors directory (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template as a user turn")
    p.add_argument("-n", "--max-tokens", type=int_at_least(1), default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float_in(0), default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int_at_least(0), default=40, help="0 = off (default 40)")
    p.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=0.95, help="in (0, 1] (default 0.95)")
    p.add_argument("--min-p", type=float_in(0, 1), default=0.05, help="in [0, 1] (default 0.05)")
    p.add_argument("--seed", type=int_at_least(0), default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_threads_and_context(p, "context limit (default: the model's)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    _add_device_options(p)
    p.set_defaults(func=_run_generate)


def add_threads_and_context(p, context_help):
    p.add_argument("--threads", type=int_at_least(1), default=None,
                   help="CPU threads (default: STRATA_THREADS or all)")
    p.add_argument("--max-context", type=int_at_least(1), default=None,
                   help=f"{context_help}; more than the model's is an error")


def _run_generate(args):
    from .llm import LLM

    llm = LLM(args.model, threads=args.threads, max_context=args.max_context, **device_options(args))
    if args.prompt_ids:
        prompt = args.prompt_ids
    else:
        prompt = args.prompt if args.prompt is not None else "Hello"
        if args.chat:
            prompt = llm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    out = llm.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, min_p=args.min_p, seed=args.seed, stop=args.stop,
                       ignore_eos=args.ignore_eos)
    if args.json:
        print(json.dumps({"model": llm.weights.source, "prompt_token_ids": out.prompt_token_ids,
                          "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                          "timings": out.timings}))
    else:
        print(out.text)
        t = out.timings
        logging.getLogger("strata").info(
            "prompt %d tokens in %.0f ms (%.1f tok/s), generated %d tokens in %.0f ms (%.1f tok/s), finish: %s",
            t["prompt_n"], t["prompt_ms"], t["prompt_per_second"], t["predicted_n"], t["predicted_ms"],
            t["predicted_per_second"], out.finish_reason)
    return 0


def _add_serve(sub):
    from server.body import DEFAULT_MAX_BODY_BYTES, MIB

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (the demo model when no --model is given)")
    p.add_argument("--model", help="GGUF file or HF safetensors directory (default: the built-in demo model)")
    p.add_argument("--parallel", type=int_at_least(1), default=1, help="slots: requests served at once (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8080, help="port, 1..65535 (default 8080)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (or STRATA_API_KEY)")
    p.add_argument("--decode-share", type=float_in(0, 1, low_open=True), default=None,
                   help="share of a decoding slot's rate kept while another slot reads a prompt, in (0, 1] "
                        "(default: STRATA_BATCH_DECODE_SHARE or 0.8)")
    p.add_argument("--max-queue", type=int_at_least(1), default=None,
                   help="waiting requests beyond which the server answers 429 (default 16 per slot)")
    p.add_argument("--max-body-mib", type=float_in(0, low_open=True), default=DEFAULT_MAX_BODY_BYTES / MIB,
                   help=f"largest request body in MiB; a larger one is refused with 413 before it is read "
                        f"(default {DEFAULT_MAX_BODY_BYTES / MIB:g})")
    p.add_argument("--max-connections", type=int_at_least(1), default=None,
                   help=f"client connections open at once: each holds a file descriptor and buffers, so slow or "
                        f"idle clients cannot exhaust them; more wait in the OS's accept queue (default "
                        f"{DEFAULT_MAX_CONNECTIONS}, waitress's own, or --parallel + --max-queue when that is more: "
                        f"every admitted request holds one)")
    add_threads_and_context(p, "context limit per slot (default: the model's)")
    _add_device_options(p)
    _add_conversation_options(p)
    p.add_argument("--profile-out", type=output_file, default=None,
                   help="on shutdown, save the expert usage seen while serving as an ExpertProfile (.npz; merged "
                        "into the file if it exists)")
    p.set_defaults(func=_run_serve)


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


def _run_serve(args):
    from server.serve import run

    return run(args)


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata")
    except PackageNotFoundError:
        return "(not installed: run pip install -e .)"


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming the flag, not the whole usage (subcommands' parsers are of this class)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser():
    parser = OneLineParser(prog="strata", description="Hybrid CPU/GPU engine for MoE language models")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    from placement.cli import add_subcommands

    add_subcommands(sub)  # profile, profile merge, profile show, plan
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    from gpu_kernels.errors import VramError

    from .errors import ModelError, RequestError

    try:
        return args.func(args)
    except (ModelError, RequestError, ValueError, VramError) as exc:
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder the system refuses (permissions, a full disk)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"strata: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
