"""The `strata` command line."""
import argparse
import json
import logging
import sys

from .cli_options import add_settings, config_of, llm_objects
from .cli_types import float_in, int_at_least, token_ids


def _add_generate(sub):
    p = sub.add_parser("generate", help="generate text from a prompt (the demo model when no --model is given)")
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
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_settings(p, "generate")
    p.set_defaults(func=_run_generate)


def _run_generate(args):
    from .llm import LLM

    config = config_of(args)
    llm = LLM(config=config, **llm_objects(args, config))
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
    from placement.cli import add_subcommands
    from server.serve import add_serve

    from .config_show import add_config_command
    from .setup.cli import add_setup

    add_serve(sub)
    add_subcommands(sub, load_llm)  # profile, profile merge, profile show, plan
    add_config_command(sub)
    add_setup(sub, build_parser)
    return parser


def load_llm(args):
    """The LLM of parsed arguments: `strata profile` runs on it."""
    from .llm import LLM

    return LLM(config=config_of(args))


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
