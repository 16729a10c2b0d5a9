"""`strata profile`, `strata profile merge`, `strata profile show` and `strata plan`."""
import os

from hybrid.cli_options import add_settings, config_of
from hybrid.cli_types import existing_file, float_in, int_at_least, output_file


def add_subcommands(sub, load_llm):
    """Adds `profile` (with `merge` and `show`) and `plan` to the `strata` subparsers; load_llm(args): the
    engine's LLM of parsed `profile` arguments (the engine passes it, placement does not build engines)."""
    p = sub.add_parser("profile", help="record expert usage on prompts; `profile merge` / `profile show`")
    p.add_argument("--prompts", type=existing_file,
                   help="JSONL of chat messages, or plain text with one prompt per line")
    p.add_argument("--max-tokens", type=int_at_least(1), default=128,
                   help="tokens generated per prompt (default 128)")
    p.add_argument("--temperature", type=float_in(0), default=0.8, help="sampling temperature (default 0.8)")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="seed of the first prompt, +1 per prompt (default 0)")
    p.add_argument("-o", "--output", type=output_file, help="profile to write (.npz)")
    add_settings(p, "profile")
    p.set_defaults(func=_run_profile, load_llm=load_llm)
    profile_sub = p.add_subparsers(dest="profile_command", metavar="{merge,show}")
    m = profile_sub.add_parser("merge", help="add profiles of one model together")
    m.add_argument("inputs", nargs="+", type=existing_file, help="profiles (.npz)")
    m.add_argument("-o", "--output", required=True, type=output_file, help="merged profile to write (.npz)")
    m.set_defaults(func=_run_merge)
    s = profile_sub.add_parser("show", help="tokens seen, skew, per-layer entropy and a heatmap PNG")
    s.add_argument("profile", type=existing_file, help="profile (.npz)")
    s.add_argument("--phase", choices=("all", "prefill", "decode"), default="all", help="routings to show")
    s.add_argument("--png", type=output_file, help="heatmap to write (default: the profile's name with .png)")
    s.add_argument("--no-png", action="store_true", help="print only")
    s.set_defaults(func=_run_show)
    _add_plan(sub)


def _add_plan(sub):
    p = sub.add_parser("plan", help="choose the experts each GPU holds from a profile")
    p.add_argument("-o", "--output", required=True, type=output_file, help="placement to write (.json)")
    add_settings(p, "plan", required=("model", "profile", "gpu_mib"))
    p.set_defaults(func=_run_plan)


def _run_profile(args):
    import numpy as np
    from tqdm import tqdm

    from hybrid.expert_usage import ExpertUsage

    from .profile import model_id
    from .prompts import read_prompts
    from .report import format_summary, summarize

    config = config_of(args)
    missing = [flag for flag, value in (("--model", config.model), ("--prompts", args.prompts), ("-o", args.output))
               if not value]
    if missing:
        raise ValueError(f"strata profile needs {', '.join(missing)} (or use `profile merge` / `profile show`)")
    prompts = read_prompts(args.prompts)
    llm = args.load_llm(args)
    llm.warm_up()  # the kernels compile here, with their own progress bar, not inside the first prompt's
    usage = llm.model.usage = ExpertUsage.for_config(llm.config)
    parts = []  # per prompt: (prefill [L, E], decode [L, E], tokens [2]) up to then, for the planner's check
    with tqdm(prompts, unit="prompt", desc="profiling") as bar:
        for i, prompt in enumerate(bar):
            given = prompt.text if prompt.messages is None else llm.tokenizer.encode_chat(prompt.messages)
            try:
                llm.generate(given, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed + i)
            except ValueError as exc:
                raise ValueError(f"{args.prompts} line {prompt.line}: {exc}") from None
            parts.append((usage.prefill.copy(), usage.decode.copy(), (usage.tokens_prefill, usage.tokens_decode)))
            bar.set_postfix(tokens=usage.tokens_prefill + usage.tokens_decode)
    profile = usage.to_profile(model_id(llm.weights), source=f"profile {os.path.basename(args.prompts)}")
    profile = profile.with_parts(*(np.diff(np.stack([np.zeros_like(a[0]), *a]), axis=0) for a in zip(*parts)))
    profile.save(args.output)
    print(format_summary(summarize(profile)))
    print(f"profile written to {args.output}")
    return 0


def _run_merge(args):
    from .profile import ExpertProfile

    profiles = [ExpertProfile.load(path) for path in args.inputs]
    merged = profiles[0]
    for path, other in zip(args.inputs[1:], profiles[1:]):
        try:
            merged = merged.merge(other)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    merged.save(args.output)
    print(f"{len(profiles)} profiles, {merged.tokens_prefill} prefill + {merged.tokens_decode} decode tokens, "
          f"written to {args.output}")
    return 0


def _run_show(args):
    from .profile import ExpertProfile
    from .report import format_summary, summarize, write_heatmap

    profile = ExpertProfile.load(args.profile)
    print(format_summary(summarize(profile, args.phase)))
    if not args.no_png:
        png = args.png or os.path.splitext(args.profile)[0] + ".png"
        if write_heatmap(profile, png, args.phase):
            print(f"heatmap written to {png}")
        else:
            print("heatmap skipped: matplotlib is not installed (pip install 'strata[plot]')")
    return 0


def _run_plan(args):
    from hybrid.formats import load_model
    from hybrid.request import context_limit

    from .budget import ModelSizes
    from .planner import Budgets, Speeds, plan
    from .profile import ExpertProfile, model_id

    config = config_of(args)
    weights = load_model(config.model)
    profile = ExpertProfile.load(config.profile)
    profile.check_model(weights.config.num_layers, weights.config.num_experts, model_id(weights))
    max_context = context_limit(config.max_context, weights.config.context_length, weights.source)
    budgets = Budgets(config.gpu_mib, config.parallel, max_context, config.kv, config.vram_reserve_mib,
                      config.layer_split, config.kv_resident)
    placement = plan(profile, ModelSizes.from_weights(weights), budgets, Speeds(config.cpu_gbps, config.gpu_gbps))
    placement.model_id = model_id(weights)
    placement.save(args.output)
    print(format_plan(placement))
    print(f"placement written to {args.output}")
    return 0


def format_plan(placement):
    lines = []
    for g in placement.gpus:
        b = g.budget
        lines.append(f"GPU {g.gpu}: layers {g.first_layer}-{g.last_layer - 1}, {b['total_mib']:.0f} MiB = dense "
                     f"{b['dense_mib']:.0f} + KV {b['kv_mib']:.0f} + scratch {b['scratch_mib']:.0f} + reserve "
                     f"{b['reserve_mib']:.0f} + {b['expert_slots']} expert slots of {b['slot_mib']:.1f} MiB "
                     f"({len(g.resident)} used)")
    s = placement.settings
    lines.append(f"predicted at batch {placement.predicted['batch']} (CPU {s['cpu_gbps']:g} GB/s, "
                 f"GPU {s['gpu_gbps']:g} GB/s, {s['profile_tokens']} tokens profiled, from {s['profile_phase']}):")
    lines.append(f"  {'':14s}{'resident':>9s}{'hit rate':>10s}{'decode tok/s':>14s}{'step ms':>9s}")
    rows = [("plan", placement.predicted), ("uniform", placement.baselines["uniform"]),
            ("global top-k", placement.baselines["global_top"])]
    for name, p in rows:
        lines.append(f"  {name:14s}{p['resident']:9d}{p['hit_rate']:10.1%}{p['decode_tok_s']:14.1f}{p['step_ms']:9.2f}")
    lines.append(format_check(s.get("check")))
    return "\n".join(lines)


def format_check(check):
    """One line on planner.cross_check's verdict."""
    if not check or not check["folds"]:
        return ("plan not checked against the global top-k: the profile has fewer than two parts (`strata profile` "
                "keeps one per prompt; `profile merge` keeps them, a file without parts counting as one)")
    verdict = "the plan is kept" if check["keep"] else "not shown: the cache holds the global top-k by the counts"
    return (f"checked on {check['folds']} folds of the profile: the plan's gain over the global top-k "
            f"{check['gain_ms']:+.4f} ms +- {check['gain_se_ms']:.4f} a step ({check['hit_points']:+.2f} hit-rate "
            f"points held out): {verdict}")
