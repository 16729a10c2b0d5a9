"""The engine's command-line options, made from EngineConfig's settings (hybrid/config.py), and the
EngineConfig and LLM objects of parsed arguments; shared by `strata generate`, `serve` and `profile`."""
import argparse

from .cli_types import existing_file
from .config import SETTINGS, EngineConfig, choice, switch

DYNAMIC_FLAGS = {"decay": float, "margin": float, "min_score": float, "max_swaps": int, "max_pending": int}


def add_setting(p, name, default=None, **overrides):
    """The flag of EngineConfig setting `name`: its parser and help; `default` None means not given, so that
    the environment and then the config's default apply (EngineConfig.resolve)."""
    meta = SETTINGS[name].metadata
    parse = meta["parse"]
    shown = SETTINGS[name].default if default is None else default
    notes = ([] if shown is None or "default" in meta["help"] else [f"default {shown}"]) + (
        [f"env {meta['env']}"] if meta["env"] else [])
    options = dict(dest=name, default=default, help=meta["help"] + (f" ({'; '.join(notes)})" if notes else ""))
    if isinstance(parse, choice):
        options["choices"] = parse.choices
    elif parse is switch:  # a --no-X flag
        options.update(action="store_const", const=False, help=meta["help"])
    else:
        options["type"] = parse
    options.update(overrides)
    p.add_argument(meta["flag"], **options)


def settings_of(args):
    """The EngineConfig settings parsed `args` hold (None: not given)."""
    return {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}


def config_of(args, environ=None):
    """The EngineConfig of parsed `args`: their flags > the environment > defaults."""
    return EngineConfig.resolve(settings_of(args), environ)


def add_threads_and_context(p, context_help):
    add_setting(p, "threads", metavar="N")
    add_setting(p, "max_context", metavar="N", help=f"{context_help}; more than the model's is an error")


def add_device_options(p):
    add_setting(p, "kv")
    add_setting(p, "kv_resident", metavar="N")
    add_setting(p, "kv_host_attention")
    add_setting(p, "device", default="auto")
    add_setting(p, "expert_cache_mib", metavar="N|auto")
    add_setting(p, "vram_reserve_mib", metavar="N")
    p.add_argument("--placement", type=existing_file, default=None, metavar="FILE",
                   help="resident experts from `strata plan` (placement.json); refused if it does not fit")
    add_setting(p, "expert_cache", default="auto")
    p.add_argument("--profile", type=existing_file, default=None, metavar="P.npz",
                   help="expert profile (`strata profile`) to plan the expert cache from at start-up")
    add_setting(p, "prefill_borrow", help="never copy non-resident experts to the GPU for large prompt chunks "
                                          "(prefill borrow)")
    _add_dynamic_options(p)


def llm_objects(args):
    """LLM's keywords that are not settings: placement, profile, dynamic (the --dynamic-* flags)."""
    return dict(placement=args.placement, profile=args.profile, dynamic=dynamic_settings(args))


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
