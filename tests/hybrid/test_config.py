"""EngineConfig (hybrid/config.py): every setting documented in the README's settings tables and nothing else,
flags / keywords over the STRATA_* environment over defaults, and bad values as one line naming the setting.
These are the tests of the environment layer itself: they pass `environ` rather than setting os.environ."""
import re
from pathlib import Path

import pytest

from hybrid.config import COMMANDS, SECTIONS, SETTINGS, EngineConfig, env_var, file_settings, flag_of

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rows():
    """The first cells of the README's topic tables (`| setting | meaning |`; the command line's own options have
    `| ... option | meaning |` tables): each a list of flag / env names."""
    rows, in_table = [], False
    for line in README.read_text().splitlines():
        if line.startswith("| setting | meaning |"):
            in_table = True
        elif in_table and line.startswith("|"):
            cell = line.split(" | ")[0]
            names = [re.split(r"[ =]", code)[0] for code in re.findall(r"`([^`]+)`", cell)]
            if names:
                rows.append(names)
        else:
            in_table = False
    return rows


def setting_names():
    """name -> the flag and env var of each setting that has either."""
    return {name: {flag_of(name), env_var(name)} - {None} for name in SETTINGS}


def test_the_readme_reference_is_generated_from_the_settings():
    from hybrid.config_doc import reference

    assert reference() in README.read_text(), "run python -m hybrid.config_doc README.md"
    for name in file_settings():
        assert f"| `{name}` |" in reference()


def test_the_readme_topic_tables_name_settings():
    rows = readme_rows()
    documented = [n for row in rows for n in row]
    assert len(documented) == len(set(documented)), "a flag or variable is in two rows"
    wanted = set().union(*setting_names().values())
    assert set(documented) - wanted == set(), "in the README but not an EngineConfig setting"
    by_name = {n: name for name, names in setting_names().items() for n in names}
    for row in rows:
        assert len({by_name[n] for n in row}) == 1, f"one row, one setting: {row}"


def test_every_setting_has_help_and_a_working_default():
    config = EngineConfig()
    for name, f in SETTINGS.items():
        assert f.metadata["help"], name
        assert f.metadata["internal"] or env_var(name).startswith("STRATA_"), name
        assert f.metadata["section"] in SECTIONS and set(f.metadata["commands"]) <= set(COMMANDS), name
        assert getattr(config, name) == f.default or f.default is None


def test_flags_win_over_the_environment_over_defaults():
    environ = {"STRATA_THREADS": "3", "STRATA_ACT_QUANT": "float", "STRATA_DECODE_RELAY": "0", "STRATA_KV": "f16"}
    assert EngineConfig.resolve(environ={}).threads is None
    config = EngineConfig.resolve(environ=environ)
    assert (config.threads, config.act_quant, config.decode_relay) == (3, "float", False)
    config = EngineConfig.resolve({"threads": 5, "decode_relay": True, "act_quant": None}, environ)
    assert (config.threads, config.act_quant, config.decode_relay) == (5, "float", True)  # None: not given
    assert config.kv == "f16" and EngineConfig.resolve(environ={"STRATA_KV_SEQUENCES": "4"}).kv_sequences == 1
    assert EngineConfig.resolve(environ={"STRATA_THREADS": "  "}).threads is None  # blank: unset


def test_parsed_values_from_text():
    config = EngineConfig.resolve(environ={
        "STRATA_ISA_FLOOR": " AVX2 ", "STRATA_PREFETCH_ROWS": "0", "STRATA_FUSED_DECODE": "1",
        "STRATA_PREFILL_CPU_SHARE": "0.25", "STRATA_CACHE_DIR": "/tmp/x", "STRATA_DENSE_GRAPHS": "0"})
    assert (config.isa_floor, config.prefetch_rows, config.fused_decode) == ("avx2", 0, True)
    assert (config.prefill_cpu_share, config.cache_dir, config.dense_graphs) == (0.25, "/tmp/x", False)


@pytest.mark.parametrize("var, value, message", [
    ("STRATA_THREADS", "all", "expected an integer, got 'all'"),
    ("STRATA_THREADS", "0", "must be >= 1, got 0"),
    ("STRATA_PARALLEL", "0", "must be >= 1, got 0"),
    ("STRATA_BATCH_DECODE_SHARE", "2", r"must be in \(0, 1\], got 2"),
    ("STRATA_ISA_FLOOR", "sse9", "expected one of avx, avx2, avx512, native, got 'sse9'"),
    ("STRATA_ACT_QUANT", "int4", "expected one of int16, float, int8, got 'int4'"),
    ("STRATA_PREFETCH_ROWS", "lots", "expected an integer, got 'lots'"),
    ("STRATA_PREFETCH_ROWS", "2000", r"must be in 0..1024, got 2000"),
    ("STRATA_COMPILED_DECODE", "yes", "expected 0 or 1, got 'yes'"),
    ("STRATA_FUSED_DECODE", "on", "expected 0 or 1, got 'on'"),
    ("STRATA_DECODE_RELAY", "2", "expected 0 or 1, got '2'"),
    ("STRATA_DECODE_RELAY_TOKENS", "0", "must be >= 1, got 0"),
    ("STRATA_RELAY_THREADS", "x", "expected an integer, got 'x'"),
    ("STRATA_PREFILL_CPU_SHARE", "1.5", r"must be in \[0, 1\], got 1.5"),
    ("STRATA_DENSE_GRAPHS", "true", "expected 0 or 1, got 'true'"),
    ("STRATA_CPU_GBPS", "0", "must be > 0, got 0"),
])
def test_a_bad_variable_is_one_line_naming_it(var, value, message):
    with pytest.raises(ValueError, match=f"^{var}: {message}$"):
        EngineConfig.resolve(environ={var: value})


@pytest.mark.parametrize("given, message", [
    ({"threads": 0}, "threads: must be >= 1, got 0"),
    ({"threads": 2.5}, "threads: expected an integer, got 2.5"),
    ({"kv": "f8"}, "kv: expected one of f32, f16, bf16, int8, got 'f8'"),
    ({"device": "tpu"}, "device: expected one of auto, gpu, cpu, got 'tpu'"),
    ({"decode_relay": "yes"}, "decode_relay: expected 0 or 1, got 'yes'"),
    ({"expert_cache_mib": "lots"}, "expert_cache_mib: expected a number of MiB or 'auto', got 'lots'"),
])
def test_a_bad_keyword_is_one_line_naming_it(given, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig(**given)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        EngineConfig.resolve(given, environ={})


def test_an_unknown_setting_is_refused():
    with pytest.raises(TypeError, match="unknown setting thread"):
        EngineConfig.resolve({"thread": 2})


def test_flags_are_made_from_the_settings(capsys):
    from hybrid.cli import build_parser
    from hybrid.cli_options import config_of

    args = build_parser().parse_args(["generate", "--threads", "2", "--kv", "f16", "--no-prefill-borrow"])
    config = config_of(args, environ={"STRATA_THREADS": "7", "STRATA_ACT_QUANT": "float"})
    assert (config.threads, config.kv, config.prefill_borrow, config.act_quant) == (2, "f16", False, "float")
    assert config.device == "auto"  # the CLI's default; EngineConfig's (and LLM's) is cpu
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--threads", "0"])
    assert "argument --threads: must be >= 1, got 0" in capsys.readouterr().err


def test_defaults_match_the_parts_that_use_them():
    """config.py keeps its defaults and names without importing the parts: they must agree."""
    from cpu_kernels.act_quant import ACT_QUANTS
    from cpu_kernels.target import ISA_FLOORS
    from hybrid import config
    from hybrid.backends import DEVICES
    from hybrid.backends.gpu import DEFAULT_RESERVE_MIB, KV_HOST_ATTENTION
    from hybrid.kv_store import KV_DTYPES, STORES
    from hybrid.residency import EXPERT_CACHE_MODES
    from hybrid.scheduler import DEFAULT_DECODE_SHARE
    from placement.dynamic import DynamicSettings
    from placement.planner import DEFAULT_CPU_GBPS, DEFAULT_GPU_GBPS
    from server.body import DEFAULT_MAX_BODY_BYTES, MIB

    assert config.ISA_FLOORS == tuple(ISA_FLOORS) and set(config.ACT_QUANTS) == set(ACT_QUANTS)
    assert (config.KV_DTYPES, config.DEVICES, config.EXPERT_CACHE_MODES, config.KV_HOST_ATTENTION) == (
        KV_DTYPES, DEVICES, EXPERT_CACHE_MODES, KV_HOST_ATTENTION)
    assert (config.DEFAULT_RESERVE_MIB, config.DEFAULT_DECODE_SHARE) == (DEFAULT_RESERVE_MIB, DEFAULT_DECODE_SHARE)
    assert (config.DEFAULT_CPU_GBPS, config.DEFAULT_GPU_GBPS) == (DEFAULT_CPU_GBPS, DEFAULT_GPU_GBPS)
    assert config.DEFAULT_MAX_BODY_MIB * MIB == DEFAULT_MAX_BODY_BYTES
    assert set(config.PARKED_KV) == set(STORES)
    for name in ("decay", "margin", "min_score", "max_swaps", "max_pending"):  # said in the help
        assert f"(default {getattr(DynamicSettings, name)})" in SETTINGS[f"dynamic_{name}"].metadata["help"]


def test_llm_takes_a_config_and_keyword_settings(demo_path):
    import hybrid

    llm = hybrid.LLM(demo_path, EngineConfig(max_context=64, kv="f16"), act_quant="float")
    assert (llm.settings.max_context, llm.settings.kv, llm.settings.act_quant) == (64, "f16", "float")
    assert llm.max_context == 64 and llm.model.kv_dtype == "f16"
    with pytest.raises(TypeError, match="unknown setting"):
        hybrid.LLM(demo_path, kv_type="f16")
    with pytest.raises(ValueError, match="^max_context: must be >= 1, got 0$"):
        hybrid.LLM(demo_path, max_context=0)


def test_an_isa_floor_after_the_kernels_were_imported_is_refused(demo_path):
    import hybrid

    with pytest.raises(ValueError, match="isa_floor 'avx': the kernels were imported for 'native'"):
        hybrid.LLM(demo_path, isa_floor="avx")
