"""The engine's command-line options, made from EngineConfig's settings (hybrid/config.py), and the
EngineConfig and LLM objects of parsed arguments; shared by `strata generate`, `serve`, `profile`, `plan` and
`config show`."""
from .config import SECTIONS, SETTINGS, choice, flag_of, env_var, resolve_sources, switch
from .config_file import find_config, read_config

DYNAMIC_FIELDS = ("decay", "margin", "min_score", "max_swaps", "max_pending")  # DynamicSettings' fields


def add_setting(p, name, **overrides):
    """The flag of EngineConfig setting `name`, with its parser and help. Its argparse default is None (not
    given), so that the environment, the config file and then the defaults apply (config_of)."""
    f = SETTINGS[name]
    meta, parse = f.metadata, f.metadata["parse"]
    shown = meta["cli_default"] if meta["cli_default"] is not None else f.default
    notes = ([] if shown is None or "default" in meta["help"] else [f"default {shown}"]) + [f"env {env_var(name)}"]
    options = dict(dest=name, default=None, help=f"{meta['help']} ({'; '.join(notes)})")
    if isinstance(parse, choice):
        options["choices"] = parse.choices
    elif parse is switch:  # a --no-X flag of a setting on by default, else an --X flag
        options.update(action="store_const", const=not f.default)
    else:
        options["type"] = parse
    if meta["metavar"]:
        options["metavar"] = meta["metavar"]
    options.update(overrides)
    p.add_argument(flag_of(name), **options)


def add_settings(p, command, required=()):
    """The flags of every setting `command` has (None: every setting's flag), in argument groups by section,
    and --config; `required`: settings the command needs (checked by config_of: a config file may give them)."""
    p.add_argument("--config", default=None, metavar="FILE", help="settings file (TOML; default $STRATA_CONFIG, "
                   "else ~/.config/strata/strata.toml when it exists); flags and STRATA_* variables win over it")
    groups = {}
    for name, f in SETTINGS.items():
        if command in f.metadata["commands"] or (command is None and f.metadata["commands"]):
            section = f.metadata["section"]
            if section not in groups:
                groups[section] = p.add_argument_group(f"{SECTIONS[section]} settings")
            add_setting(groups[section], name)
    p.set_defaults(required_settings=tuple(required), settings_command=command or "config")


def settings_of(args):
    """The EngineConfig settings parsed `args` hold (None: not given)."""
    return {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}


def command_defaults(command):
    """The defaults of `command` where they differ from the library's (device auto for the commands with a
    --device flag; `config show` shows those of `serve`)."""
    command = "serve" if command == "config" else command
    return {name: f.metadata["cli_default"] for name, f in SETTINGS.items()
            if f.metadata["cli_default"] is not None and command in f.metadata["commands"]}


def config_and_sources(args, environ=None):
    """(EngineConfig, {name: source}) of parsed `args`: their flags > the environment > the config file >
    the commands' defaults > the library's."""
    path = find_config(getattr(args, "config", None), environ)
    file = read_config(path) if path else None
    defaults = command_defaults(getattr(args, "settings_command", None))
    config, sources = resolve_sources(settings_of(args), environ, file, defaults, flags=True)
    missing = [flag_of(n) for n in getattr(args, "required_settings", ()) if getattr(config, n) is None]
    if missing:
        raise ValueError(f"strata {args.settings_command} needs {', '.join(missing)} (a flag, its STRATA_* variable or "
                         f"the config file)")
    return config, sources


def config_of(args, environ=None):
    """The EngineConfig of parsed `args` (config_and_sources)."""
    return config_and_sources(args, environ)[0]


def llm_objects(args, config=None):
    """LLM's keywords that are not EngineConfig fields: placement, profile, dynamic (the dynamic_* settings),
    from `config` (default: config_of(args))."""
    config = config or config_of(args)
    return dict(placement=config.placement, profile=config.profile, dynamic=dynamic_settings(config))


def dynamic_settings(config):
    """The DynamicSettings of the dynamic_* settings (None when none is given); ValueError when one is given
    without expert_cache dynamic."""
    from placement.dynamic import DynamicSettings

    given = {f: getattr(config, f"dynamic_{f}") for f in DYNAMIC_FIELDS if getattr(config, f"dynamic_{f}") is not None}
    if not given:
        return None
    if config.expert_cache != "dynamic":
        flags = ", ".join(flag_of(f"dynamic_{f}") for f in given)
        raise ValueError(f"{flags}: only with --expert-cache dynamic (got --expert-cache {config.expert_cache})")
    return DynamicSettings(**given)
