"""`strata config show`: every setting's effective value and where it came from (a flag, a STRATA_* variable,
the config file's line, or the default)."""
from .cli_options import add_settings, config_and_sources
from .config import file_settings
from .config_file import find_config


def add_config_command(sub):
    """The `config` subcommand (`config show`) of the `strata` subparsers."""
    p = sub.add_parser("config", help="the settings: `config show` prints each effective value and its source")
    config_sub = p.add_subparsers(dest="config_command", metavar="{show}", required=True)
    s = config_sub.add_parser("show", help="each setting's effective value and where it came from; takes every "
                                           "command's setting flags")
    s.add_argument("--toml", action="store_true", help="print the values as a config file instead")
    add_settings(s, None)
    s.set_defaults(func=run_show)


def format_value(value):
    """A setting's value as TOML: text quoted, tuples as comma-separated text, None: unset."""
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return '"' + ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) + '"'
    if isinstance(value, float):
        return repr(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def show_lines(config, sources, config_path=None):
    """The lines of `config show`: name, value, source, one setting a line."""
    names = file_settings()
    width = max(len(n) for n in names)
    values = {n: format_value(getattr(config, n)) for n in names}
    value_width = min(40, max(len(v) for v in values.values()))
    head = [f"# config file: {config_path or 'none'}"]
    return head + [f"{n:{width}s}  {values[n]:{value_width}s}  {sources[n]}" for n in names]


def toml_lines(config, sources):
    """The settings that do not come from the defaults, as a config file."""
    return [f"{n} = {format_value(getattr(config, n))}" for n in file_settings()
            if getattr(config, n) is not None and not sources[n].startswith("default")]


def run_show(args):
    config, sources = config_and_sources(args)
    if args.toml:
        print("\n".join(toml_lines(config, sources)))
    else:
        print("\n".join(show_lines(config, sources, find_config(args.config))))
    return 0

