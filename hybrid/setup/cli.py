"""`strata setup [--model M] [--profile P | --prompts FILE] [-o strata.toml] [--dry-run] [--check]`: measure,
(profile the prompts,) choose, write (or with --dry-run only print the diff), print the predictions; --check
runs a short generation with the result and compares its decode speed with the prediction."""
import logging
import os

from ..cli_types import existing_file, int_at_least, output_file
from .choose import PREDICT_CONTEXT

log = logging.getLogger(__name__)

DEFAULT_OUTPUT = "strata.toml"


def add_setup(sub, build_parser):
    """The `setup` subcommand of the `strata` subparsers; build_parser() makes the whole `strata` parser (setup's
    --prompts runs `strata profile` through it)."""
    p = sub.add_parser("setup", help="measure this box, choose the settings for a model and write them to a "
                                     "config file (keeping the values you set)")
    p.add_argument("--model", help="GGUF file or HF safetensors directory to set up for (default: the config "
                                   "file's model)")
    p.add_argument("--profile", type=existing_file, default=None, metavar="P.npz",
                   help="expert profile (`strata profile`) of your prompts: the placement is planned from it "
                        "(written beside the config) and so are the predictions (default: every expert alike)")
    p.add_argument("--prompts", type=existing_file, default=None, metavar="FILE",
                   help="prompts of your workload (JSONL of chat messages, or one prompt a line): without --profile, "
                        "`strata profile` records their expert usage first (written beside the config)")
    p.add_argument("-o", "--output", type=output_file, default=DEFAULT_OUTPUT,
                   help=f"config file to write or update (default {DEFAULT_OUTPUT})")
    p.add_argument("--dry-run", action="store_true", help="print the diff setup would make; write nothing")
    p.add_argument("--check", action="store_true", help="then generate a few tokens with the result and compare "
                                                        "the decode speed with the prediction")
    p.add_argument("--check-tokens", type=int_at_least(2), default=32, help="tokens --check generates (default 32)")
    p.add_argument("--predict-context", type=int_at_least(1), default=PREDICT_CONTEXT, metavar="TOKENS",
                   help="the context (tokens a conversation holds) the decode predictions are for (default "
                        f"{PREDICT_CONTEXT}; they are also printed at the chosen max_context)")
    p.add_argument("--read-mib", type=int_at_least(8), default=512,
                   help="MiB the DRAM bandwidth is timed over (default 512: beyond any cache)")
    p.set_defaults(func=run_setup, build_parser=build_parser)


def measure_box(read_mib, weights):
    """The Machine of this box, with the expert kernels timed over `weights` (measure.measure; tests replace
    this)."""
    from .measure import measure

    return measure(read_mib, weights)


def run_setup(args):
    from hybrid.formats import load_model

    from .choose import Choice, choose
    from .write import merge

    old = _read_lines(args.output)
    fixed, model = _fixed_and_model(args, old)
    weights = load_model(model)
    machine = measure_box(args.read_mib, weights)
    profile_path = args.profile or (_record_profile(args, model) if args.prompts else None)
    profile = _profile(profile_path, weights)
    plan = choose(machine, weights, fixed, profile, args.predict_context)
    choices = [Choice("model", os.path.abspath(model), f"the model setup measured for ({weights.config.arch}, "
                                                        f"{weights.config.num_layers} layers)")] + plan.choices
    placement_path = os.path.splitext(args.output)[0] + ".placement.json"
    if plan.placement is not None:
        choices.append(Choice("placement", os.path.abspath(placement_path), f"planned from {profile_path} for the "
                              f"measured GPUs: hit rate {plan.placement.predicted['hit_rate']:.0%}"))
    new, report = merge(old, [c for c in choices if c.name not in fixed], machine.describe())
    print(_predictions(machine, plan))
    print("\n".join(report))
    if not args.dry_run:
        _write(args.output, new, plan.placement, placement_path)
    _print_changes(args, old, new)
    if args.check:
        print(_check(args, new, plan))
    return 0


def _check(args, lines, plan):
    """--check's line, run on the written file, or with --dry-run on the proposed one (in a temporary file)."""
    import tempfile

    from .check import check

    if not args.dry_run:
        return check(args.output, plan, args.check_tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "strata.toml")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return check(path, plan, args.check_tokens)


def _fixed_and_model(args, old):
    """({key: value} of the user's keys in the config file, the model to set up for: --model, else the
    file's). A broken file is one line naming its line, before minutes of measuring."""
    from hybrid.config import resolve_sources
    from hybrid.config_file import read_config

    from .write import user_values

    values = resolve_sources(environ={}, file=read_config(args.output))[0] if old else None
    fixed = {k: getattr(values, k) for k in user_values(old)}
    model = args.model or (values.model if values else None)
    if model is None:
        raise ValueError("strata setup needs --model (or a model in the config file -o names)")
    if "model" in fixed and os.path.abspath(model) != os.path.abspath(fixed["model"]):
        raise ValueError(f"--model {args.model}: {args.output} sets model = {fixed['model']!r} itself; set up "
                         f"for that one, or remove it from the file")
    return fixed, model


def _write(path, lines, placement, placement_path):
    """The config file (checked by reading it back) and the placement beside it."""
    from hybrid.config_file import read_config

    if placement is not None:
        placement.save(placement_path)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    read_config(path)


def _print_changes(args, old, new):
    from .write import diff

    if args.dry_run:
        changes = diff(old, new, args.output)
        print("\n".join(changes) if changes else f"{args.output}: no change")
    else:
        print(f"{args.output} written; start with: strata serve --config {args.output}")


def _read_lines(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def _record_profile(args, model, max_tokens=64):
    """`strata profile` of --prompts (with the config file's settings when it exists): the profile's path."""
    path = os.path.splitext(args.output)[0] + ".profile.npz"
    argv = ["profile", "--model", model, "--prompts", args.prompts, "-o", path, "--max-tokens", str(max_tokens)]
    profile_args = args.build_parser().parse_args(argv + (["--config", args.output] if os.path.isfile(args.output) else []))
    profile_args.func(profile_args)
    return path


def _profile(path, weights):
    if path is None:
        return None
    from placement.profile import ExpertProfile, model_id

    profile = ExpertProfile.load(path)
    profile.check_model(weights.config.num_layers, weights.config.num_experts, model_id(weights))
    return profile


def _predictions(machine, plan):
    gpus = ", ".join(f"GPU {i}: {mib:.0f} of {g.vram_mib:.0f} MiB" for i, (mib, g) in
                     enumerate(zip(plan.vram_mib, machine.gpus))) or "no GPU"
    slots, longest = plan.parallel, plan.value("max_context")
    busy = f", {plan.decode_tok_s:.1f} per slot with {slots} decoding" if slots > 1 else ""
    full = (f" (at {longest} tokens: {plan.alone_at(longest):.1f} alone)"
            if isinstance(longest, int) and longest > plan.context else "")
    return (f"predicted: decode {plan.alone_tok_s:.1f} tok/s alone{busy} at {plan.context} tokens of context{full}; "
            f"VRAM {gpus}; RAM {plan.ram_mib:.0f} of {machine.free_ram_mib:.0f} MiB free")
