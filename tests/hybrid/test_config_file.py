"""The config file layer (hybrid/config_file.py) and `strata config show`: flag > env > file > default for every
kind of setting, where each value came from, and one-line errors naming the file, the line and the key."""
import pytest

from hybrid.cli import build_parser, main
from hybrid.cli_options import config_and_sources
from hybrid.config import env_var, flag_of
from hybrid.config_file import ConfigError, find_config, read_config

# one setting of each kind: (name, flag value, env value, file text, default, flag's / env's / file's value)
KINDS = [
    ("threads", "2", "3", "threads = 4", None, 2, 3, 4),  # integer
    ("decode_share", "0.5", "0.6", "decode_share = 0.7", 0.8, 0.5, 0.6, 0.7),  # number
    ("kv", "f16", "bf16", 'kv = "int8"', "f32", "f16", "bf16", "int8"),  # choice
    ("expert_cache_mib", "100", "200", "expert_cache_mib = 300", None, 100.0, 200.0, 300.0),  # MiB or auto
    ("api_key", "a", "b", 'api_key = "c"', None, "a", "b", "c"),  # text
]
SWITCH = ("prefill_borrow", "STRATA_PREFILL_BORROW")  # a --no-X flag: flag False, env 1, file false


def resolved(argv, environ, tmp_path, text=None):
    environ = dict(environ, HOME=str(tmp_path))  # no ~/.config/strata/strata.toml but the test's
    if text is not None:
        (tmp_path / "s.toml").write_text(text + "\n")
        argv = argv + ["--config", str(tmp_path / "s.toml")]
    return config_and_sources(build_parser().parse_args(["serve", *argv]), environ)


@pytest.mark.parametrize("name, flag, env, file, default, by_flag, by_env, by_file", KINDS, ids=[k[0] for k in KINDS])
def test_a_flag_wins_over_the_environment_over_the_file_over_the_default(name, flag, env, file, default, by_flag,
                                                                          by_env, by_file, tmp_path):
    option, var = flag_of(name), env_var(name)
    config, sources = resolved([], {}, tmp_path)
    assert (getattr(config, name), sources[name]) == (default, "default")
    config, sources = resolved([], {}, tmp_path, file)
    assert (getattr(config, name), sources[name]) == (by_file, f"{tmp_path / 's.toml'} line 1")
    config, sources = resolved([], {var: env}, tmp_path, file)
    assert (getattr(config, name), sources[name]) == (by_env, var)
    config, sources = resolved([option, flag], {var: env}, tmp_path, file)
    assert (getattr(config, name), sources[name]) == (by_flag, option)


def test_a_switch_and_the_command_default(tmp_path):
    config, sources = resolved([], {}, tmp_path, "prefill_borrow = false")
    assert config.prefill_borrow is False and sources["prefill_borrow"].endswith("line 1")
    config, sources = resolved([], {SWITCH[1]: "1"}, tmp_path, "prefill_borrow = false")
    assert config.prefill_borrow is True and sources["prefill_borrow"] == SWITCH[1]
    config, sources = resolved(["--no-prefill-borrow"], {SWITCH[1]: "1"}, tmp_path)
    assert config.prefill_borrow is False and sources["prefill_borrow"] == "--no-prefill-borrow"
    config, sources = resolved([], {}, tmp_path)
    assert (config.device, sources["device"]) == ("auto", "default (command)")
    config, sources = resolved([], {}, tmp_path, 'device = "cpu"\nlayer_split = "29"')
    assert config.device == "cpu" and config.layer_split == (29,)


def test_the_file_is_found_by_flag_variable_or_home(tmp_path):
    home = tmp_path / ".config" / "strata"
    home.mkdir(parents=True)
    (home / "strata.toml").write_text("parallel = 2\n")
    named = tmp_path / "named.toml"
    named.write_text("parallel = 3\n")
    assert find_config(None, {"HOME": str(tmp_path)}) == str(home / "strata.toml")
    assert find_config(None, {"HOME": str(tmp_path), "STRATA_CONFIG": str(named)}) == str(named)
    assert find_config(str(named), {"HOME": "/nowhere"}) == str(named)
    assert find_config(None, {"HOME": "/nowhere"}) is None
    config, sources = config_and_sources(build_parser().parse_args(["serve"]), {"HOME": str(tmp_path)})
    assert config.parallel == 2 and sources["parallel"] == f"{home / 'strata.toml'} line 1"
    with pytest.raises(ConfigError, match="^STRATA_CONFIG /nowhere.toml: no such file$"):
        find_config(None, {"STRATA_CONFIG": "/nowhere.toml"})


@pytest.mark.parametrize("text, message", [
    ('kv = "f16"\n\nthreadz = 4\n', "line 3: unknown setting 'threadz' (did you mean threads?)"),
    ('# a comment\nthreads = "8"\n', "line 2: threads: expected an integer, got '8'"),
    ("parallel = 4\nprefill_borrow = 1\n", "line 2: prefill_borrow: expected true or false, got 1"),
    ("decode_share = true\n", "line 1: decode_share: expected a number, got True"),
    ('port = 80\nkv = "f8"\n', "line 2: kv: expected one of f32, f16, bf16, int8, got 'f8'"),
    ("port = 70000\n", "line 1: port: must be in 1..65535, got 70000"),
    ('[serve]\nparallel = 4\n', "line 1: unknown setting 'serve'"),
    ("threads = \n", "line 1: not valid TOML: invalid value"),
    ('kv = "f16"\nkv = "f32"\n', "line 2: not valid TOML: cannot overwrite a value"),
    ("kv_sequences = 2\n", "line 1: unknown setting 'kv_sequences'"),
])
def test_a_bad_file_is_one_line_naming_the_file_line_and_key(text, message, tmp_path, capsys):
    path = tmp_path / "strata.toml"
    path.write_text(text)
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"strata: error: {path} {message}") and len(err.splitlines()) == 1, err


def test_read_config_gives_values_and_lines(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('# setup\nkv = "f16"\n"parallel" = 2\ngpu_mib = [24000, 24000]\n')
    assert read_config(str(path)) == {"kv": ("f16", f"{path} line 2"), "parallel": (2, f"{path} line 3"),
                                      "gpu_mib": ([24000, 24000], f"{path} line 4")}


def test_config_show_prints_every_value_and_its_source(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("STRATA_PARALLEL", "3")
    path = tmp_path / "s.toml"
    path.write_text('kv = "f16"\nparallel = 2\n')
    assert main(["config", "show", "--config", str(path), "--threads", "5"]) == 0
    lines = {line.split()[0]: line.split(None, 2)[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["kv"] == ['"f16"', f"{path} line 1"]
    assert lines["parallel"] == ["3", "STRATA_PARALLEL"]
    assert lines["threads"] == ["5", "--threads"]
    assert lines["port"] == ["8080", "default"]
    assert main(["config", "show", "--config", str(path), "--toml"]) == 0
    assert capsys.readouterr().out.splitlines() == ['kv = "f16"', "parallel = 3"]


def test_plan_takes_its_required_settings_from_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["plan", "-o", str(tmp_path / "p.json")]) == 2
    assert capsys.readouterr().err.strip() == ("strata: error: strata plan needs --model, --profile, --gpu-mib (a "
                                               "flag, its STRATA_* variable or the config file)")


def test_the_isa_floor_of_the_found_file_is_applied_at_import(tmp_path, monkeypatch):
    from hybrid import config
    from hybrid.config_file import file_isa_floor

    applied = []
    monkeypatch.setattr("cpu_kernels.target.apply_isa_floor", lambda floor: applied.append(floor) or floor)
    monkeypatch.setattr(config, "_applied_floor", config._applied_floor)
    path = tmp_path / "s.toml"
    path.write_text('isa_floor = "AVX"\n')
    environ = {"STRATA_CONFIG": str(path)}
    assert file_isa_floor(environ) == "avx" and config.apply_isa_floor("avx", environ) == "avx"
    assert config.apply_isa_floor("avx", {**environ, "STRATA_ISA_FLOOR": "avx2"}) == "avx2"
    path.write_text("isa_floor = 3\n")  # reported by the command that reads the file, not at import
    assert file_isa_floor(environ) is None and file_isa_floor({"HOME": str(tmp_path)}) is None
    assert config.apply_isa_floor(None, {}) == "native" and applied == ["avx", "avx2", "native"]


def test_load_config_for_python(tmp_path):
    from hybrid.config_file import load_config

    path = tmp_path / "s.toml"
    path.write_text('kv = "f16"\nthreads = 3\n')
    config = load_config(str(path), {"STRATA_THREADS": "4"}, parallel=2)
    assert (config.kv, config.threads, config.parallel, config.device) == ("f16", 4, 2, "cpu")
    assert load_config(None, {"HOME": str(tmp_path)}).kv == "f32"
