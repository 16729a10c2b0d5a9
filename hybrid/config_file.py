"""The config file: TOML whose keys are EngineConfig's setting names (`kv = "f16"`, `parallel = 4`), read with
the standard library's tomllib.

Found at `--config FILE`, else `$STRATA_CONFIG`, else `~/.config/strata/strata.toml` (`$XDG_CONFIG_HOME` when
set) when that file exists. An unknown key, a value of the wrong type or a bad value is one line naming the
file, the line and the key: "strata.toml line 3: threads: expected an integer, got '8'". Paths in it are
taken as written (relative ones from the working directory).
"""
import difflib
import os
import re
import tomllib

from .config import SETTINGS, _parsed, file_settings, resolve_sources
from .config_types import mib_or_auto

CONFIG_VAR = "STRATA_CONFIG"
FILE_NAME = "strata.toml"
_TYPES = {int: ((int,), "an integer"), float: ((int, float), "a number"), bool: ((bool,), "true or false"),
          str: ((str,), "text")}  # a field's type: the TOML types it takes


class ConfigError(ValueError):
    """A config file that cannot be used: one line naming the file, the line and the key."""


def default_path(environ):
    """~/.config/strata/strata.toml (under $XDG_CONFIG_HOME when set), or None without a home."""
    base = environ.get("XDG_CONFIG_HOME", "").strip()
    if not base:
        home = environ.get("HOME", "").strip()
        if not home:
            return None
        base = os.path.join(home, ".config")
    return os.path.join(base, "strata", FILE_NAME)


def find_config(given=None, environ=None):
    """The config file to read: `given` (--config), else $STRATA_CONFIG, else the default path when it exists;
    None when there is none. A named file that does not exist is a ConfigError."""
    environ = os.environ if environ is None else environ
    named = given or environ.get(CONFIG_VAR, "").strip()
    if named:
        if not os.path.isfile(named):
            where = "--config" if given else CONFIG_VAR
            raise ConfigError(f"{where} {named}: no such file")
        return named
    path = default_path(environ)
    return path if path and os.path.isfile(path) else None


def load_config(path=None, environ=None, **given):
    """The EngineConfig of `given` keywords > the STRATA_* environment > the config file at `path` (None:
    $STRATA_CONFIG, else ~/.config/strata/strata.toml when it exists) > the defaults: for Python what
    `strata serve --config` does (`hybrid.LLM(config=load_config("strata.toml"))`)."""
    path = find_config(path, environ)
    return resolve_sources(given, environ, read_config(path) if path else None)[0]


def key_line(lines, key):
    """The 1-based line where `key` is set (or its table opens), else None."""
    pattern = re.compile(rf"""^\s*(\[+\s*)?(["']?){re.escape(key)}\2\s*(=|\]|\.)""")
    return next((i + 1 for i, line in enumerate(lines) if pattern.match(line)), None)


def _check_type(name, value):
    """The one-line complaint about a value of the wrong TOML type for setting `name`, or None."""
    f = SETTINGS[name]
    wanted = _TYPES.get(f.type)
    if wanted is None or (f.metadata["parse"] is mib_or_auto and value == "auto"):
        return None
    types, what = wanted
    if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
        return None
    shown = f"{value!r}" if isinstance(value, (str, int, float)) else f"a {type(value).__name__}"
    return f"expected {what}, got {shown}"


def read_config(path):
    """{name: (value, where)} of the config file at `path` (where: "PATH line N"); ConfigError when it is not
    valid TOML, holds a key that is no setting or a value of the wrong type."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a TOML file (not UTF-8 text)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(_toml_error(path, exc)) from None
    lines = text.splitlines()
    known = set(file_settings())
    values = {}
    for key, value in data.items():
        line = key_line(lines, key)
        where = f"{path} line {line}" if line else path
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (`strata config show` lists the settings)"
            raise ConfigError(f"{where}: unknown setting {key!r}{hint}")
        problem = _check_type(key, value)
        if problem:
            raise ConfigError(f"{where}: {key}: {problem}")
        values[key] = (value, where)
    return values


def _toml_error(path, exc):
    """tomllib's "Invalid value (at line 3, column 7)" as "PATH line 3: not valid TOML: invalid value"."""
    message = str(exc)
    found = re.search(r"\s*\(at line (\d+), column \d+\)$", message)
    if found:
        message = message[: found.start()]
        return f"{path} line {found.group(1)}: not valid TOML: {message[:1].lower()}{message[1:]}"
    return f"{path}: not valid TOML: {message[:1].lower()}{message[1:]}"


def file_isa_floor(environ=None):
    """isa_floor of the config file found without --config ($STRATA_CONFIG, ~/.config/strata/strata.toml), or
    None. Read when hybrid is imported: a broken file is reported by the command that reads it, not here."""
    try:
        path = find_config(None, environ)
        found = read_config(path).get("isa_floor") if path else None
        return _parsed(SETTINGS["isa_floor"], found[0], f"{found[1]}: isa_floor") if found else None
    except ValueError:
        return None
