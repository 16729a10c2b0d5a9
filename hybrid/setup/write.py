"""The config file `strata setup` writes, and how a re-run merges into the one that is there.

Each value setup writes has its own line above it, `# setup: kv = "f16" | why`, naming the value it wrote. On
a re-run a key is
- setup's when that line is there and the value is still the one it names: setup updates it (or removes it
  when it no longer sets it);
- edited when the line is there but the value was changed: left alone and reported;
- the user's when no such line is above it: left alone (and passed to the choices as given).
Every other line (comments, blank lines, the user's keys) stays as it was; new choices go at the end.
"""
import difflib
import re
import tomllib
from dataclasses import dataclass

from ..config_show import format_value

TAG = "# setup: "
MEASURED = "# measured: "  # setup's lines saying what it measured: replaced on every run
HEADER = [
    "# Strata settings (`strata config show` lists every key; README \"Settings\"), written by `strata setup`.",
    "# A value under a \"# setup:\" line is setup's: a re-run updates it while it is the value that line names.",
    "# Change it, or add keys of your own, and setup leaves them alone (and plans around them).",
]
_KEY = re.compile(r"""^\s*(["']?)([A-Za-z0-9_]+)\1\s*=\s*(.*)$""")
_TAG = re.compile(r"^# setup: ([A-Za-z0-9_]+) = (.*?) \| ")


@dataclass(frozen=True)
class Entry:
    key: str
    line: int  # 0-based index of its value line
    value: object
    tagged: object  # the value its "# setup:" line names, or None when it has none
    has_tag: bool

    @property
    def owner(self):
        """"setup" (setup may change it), "edited" (setup wrote it, the user changed it) or "user"."""
        if not self.has_tag:
            return "user"
        return "setup" if self.tagged == self.value else "edited"


def toml_value(text):
    """The value of TOML value text (`"f16"`, `4`, `true  # note`), or None when it is not one."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return None


def scan(lines):
    """{key: Entry} of the top-level keys of a config file's lines."""
    entries = {}
    for i, line in enumerate(lines):
        found = _KEY.match(line)
        if not found or line.lstrip().startswith("#"):
            continue
        key = found.group(2)
        tag = _TAG.match(lines[i - 1]) if i else None
        has_tag = bool(tag and tag.group(1) == key)
        entries[key] = Entry(key, i, toml_value(found.group(3)), toml_value(tag.group(2)) if has_tag else None,
                             has_tag)
    return entries


def user_values(lines):
    """{key: value} of the keys setup must not change (the user's and the edited ones)."""
    return {k: e.value for k, e in scan(lines).items() if e.owner != "setup"}


def choice_lines(choice):
    value = format_value(choice.value)
    return [f"{TAG}{choice.name} = {value} | {choice.why}", f"{choice.name} = {value}"]


def merge(old_lines, choices, measured=()):
    """(new lines, report lines): `choices` (choose.Choice) merged into a config file's `old_lines` (empty:
    a new file) as the module docstring says; `measured`: the "# measured:" lines, in place of the old ones."""
    lines = _with_measured(list(old_lines) if old_lines else list(HEADER), measured)
    entries, chosen = scan(lines), {c.name: c for c in choices}
    report, replaced = [], {}
    for key, entry in entries.items():
        shown = format_value(entry.value)
        if entry.owner == "setup":
            new = chosen.get(key)
            replaced[entry.line - 1] = []
            replaced[entry.line] = choice_lines(new) if new else []
            if new is None:
                report.append(f"removed {key} = {shown} (setup wrote it and no longer sets it)")
            elif format_value(new.value) != shown:
                report.append(f"updated {key}: {shown} -> {format_value(new.value)}")
        elif entry.owner == "edited":
            report.append(f"kept your {key} = {shown} (setup wrote {format_value(entry.tagged)})")
        else:
            report.append(f"kept your {key} = {shown}")
    out = []
    for i, line in enumerate(lines):
        out.extend(replaced.get(i, [line]))
    for c in choices:
        if c.name not in entries:
            out += ([""] if out and out[-1].strip() else []) + choice_lines(c)
            report.append(f"added {c.name} = {format_value(c.value)}")
    return out, report


def _with_measured(lines, measured):
    """`lines` with their "# measured:" lines replaced by `measured` (where the first one was, else after the
    leading comments)."""
    old = [i for i, line in enumerate(lines) if line.startswith(MEASURED)]
    at = old[0] if old else next((i for i, line in enumerate(lines) if not line.startswith("#")), len(lines))
    kept = [line for line in lines if not line.startswith(MEASURED)]
    return kept[:at] + [MEASURED + m for m in measured] + kept[at:]


def diff(old_lines, new_lines, path):
    """The unified diff of a config file before and after setup (empty when nothing changes)."""
    return list(difflib.unified_diff(old_lines, new_lines, fromfile=path, tofile=f"{path} (setup)", lineterm=""))
