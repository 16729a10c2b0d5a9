"""`strata setup --model M [--profile P] [-o strata.toml] [--dry-run] [--check]`: measure, choose, write (or
with --dry-run only print the diff), print the predictions; --check runs a short generation with the result
and compares its decode speed with the prediction."""
import logging
import os

from ..cli_types import existing_file, int_at_least, output_file

log = logging.getLogger(__name__)

DEFAULT_OUTPUT = "strata.toml"


def add_setup(sub):
    """The `setup` subcommand of the `strata` subparsers."""
    p = sub.add_parser("setup", help="measure this box, choose the settings for a model and write them to a "
                                     "config file (keeping the values you set)")
    p.add_argument("--model", required=True, help="GGUF file or HF safetensors directory to set up for")
    p.add_argument("--profile", type=existing_file, default=None, metavar="P.npz",
                   help="expert profile (`strata profile`) of your prompts: the placement is planned from it "
                        "(written beside the config) and so are the predictions (default: every expert alike)")
    p.add_argument("-o", "--output", type=output_file, default=DEFAULT_OUTPUT,
                   help=f"config file to write or update (default {DEFAULT_OUTPUT})")
    p.add_argument("--dry-run", action="store_true", help="print the diff setup would make; write nothing")
    p.add_argument("--check", action="store_true", help="then generate a few tokens with the result and compare "
                                                        "the decode speed with the prediction")
    p.add_argument("--check-tokens", type=int_at_least(2), default=32, help="tokens --check generates (default 32)")
    p.add_argument("--read-mib", type=int_at_least(8), default=512,
                   help="MiB the DRAM bandwidth is timed over (default 512: beyond any cache)")
    p.set_defaults(func=run_setup)


def measure_box(read_mib):
    """The Machine of this box (measure.measure; tests replace this)."""
    from .measure import measure

    return measure(read_mib)


def run_setup(args):
    from hybrid.config_file import read_config
    from hybrid.formats import load_model

    from .choose import Choice, choose
    from .write import diff, merge, user_values

    old = _read_lines(args.output)
    fixed = _fixed(args.output, user_values(old)) if old else {}
    machine = measure_box(args.read_mib)
    weights = load_model(args.model)
    profile = _profile(args.profile, weights)
    plan = choose(machine, weights, fixed, profile)
    choices = [Choice("model", os.path.abspath(args.model), f"the model setup measured for ({weights.config.arch}, "
                                                             f"{weights.config.num_layers} layers)")] + plan.choices
    if plan.placement is not None:
        placement_path = os.path.splitext(args.output)[0] + ".placement.json"
        choices.append(Choice("placement", os.path.abspath(placement_path), f"planned from {args.profile} for the "
                              f"measured GPUs: hit rate {plan.placement.predicted['hit_rate']:.0%}"))
    new, report = merge(old, [c for c in choices if c.name not in fixed])
    print(_predictions(machine, plan))
    print("\n".join(report))
    changes = diff(old, new, args.output)
    if args.dry_run:
        print("\n".join(changes) if changes else f"{args.output}: no change")
        return 0
    if plan.placement is not None:
        plan.placement.save(placement_path)
    with open(args.output, "w") as f:
        f.write("\n".join(new) + "\n")
    read_config(args.output)
    print(f"{args.output} written; start with: strata serve --config {args.output}")
    if args.check:
        from .check import check

        print(check(args.output, plan, args.check_tokens))
    return 0


def _read_lines(path):
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return f.read().splitlines()


def _fixed(path, users):
    """{key: value} of the user's keys (`users`) in the config file at `path`, parsed as settings; a broken
    file is one line naming its line, before minutes of measuring."""
    from hybrid.config import resolve_sources
    from hybrid.config_file import read_config

    config, _ = resolve_sources(environ={}, file=read_config(path))
    return {k: getattr(config, k) for k in users}


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
    slots = plan.parallel
    busy = f", {plan.decode_tok_s:.1f} per slot with {slots} decoding" if slots > 1 else ""
    return (f"predicted: decode {plan.alone_tok_s:.1f} tok/s alone{busy}; VRAM {gpus}; RAM {plan.ram_mib:.0f} of "
            f"{machine.free_ram_mib:.0f} MiB free")
