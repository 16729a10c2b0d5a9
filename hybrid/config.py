"""Every engine setting, listed once: `EngineConfig`, resolved once from flags (or `LLM` keywords) > the
`STRATA_*` environment > defaults.

Each field carries its env var, CLI flag, help and parser in its metadata (`setting(...)`); the CLI makes
its flags from them (hybrid/cli_options.py), `LLM(...)` and the server resolve the same way, and the README's
settings tables are checked against them (tests/hybrid/test_config.py). This is the only module that reads
the environment; the parts below receive plain values.

Bad values are one line naming the flag, the keyword or the variable: "STRATA_THREADS: expected an integer,
got 'all'". This module imports nothing heavy: `hybrid/__init__.py` applies the ISA floor from it before the
kernels are imported.
"""
import argparse
import math
import os
from dataclasses import dataclass, field, fields, replace

ISA_FLOORS = ("avx", "avx2", "avx512", "native")  # cpu_kernels/target.py ISA_FLOORS
ACT_QUANTS = ("int16", "float", "int8")  # cpu_kernels/act_quant.py ACT_QUANTS
KV_DTYPES = ("f32", "f16", "bf16", "int8")  # hybrid/kv_store.py KV_DTYPES
DEVICES = ("auto", "gpu", "cpu")  # hybrid/backends DEVICES
EXPERT_CACHE_MODES = ("auto", "dynamic")  # hybrid/residency.py
KV_HOST_ATTENTION = ("gpu", "cpu")  # hybrid/backends/gpu.py
DEFAULT_RESERVE_MIB = 512  # hybrid/backends/gpu.py DEFAULT_RESERVE_MIB
DEFAULT_DECODE_SHARE = 0.8  # hybrid/scheduler.py DEFAULT_DECODE_SHARE
DEFAULT_CPU_GBPS = 40.0  # placement/planner.py
DEFAULT_GPU_GBPS = 3000.0  # placement/planner.py


def _fail(message):
    raise argparse.ArgumentTypeError(message)


def integer(low, high=None):
    """An int in [low, high] (high None: no bound), from text or an int."""
    def parse(value):
        if isinstance(value, str):
            try:
                value = int(value.strip())
            except ValueError:
                _fail(f"expected an integer, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int):
            _fail(f"expected an integer, got {value!r}")
        if value < low or (high is not None and value > high):
            _fail(f"must be >= {low}, got {value}" if high is None else f"must be in {low}..{high}, got {value}")
        return value

    return parse


def number(low, high=None, low_open=False):
    """A finite float in [low, high] or (low, high] with low_open; high None: no upper bound."""
    opening = "(" if low_open else "["
    wanted = (f"{'>' if low_open else '>='} {low:g}" if high is None else f"in {opening}{low:g}, {high:g}]")

    def parse(value):
        text = value
        try:
            value = float(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            _fail(f"expected a number, got {text!r}")
        if isinstance(text, bool) or not math.isfinite(value):
            _fail(f"expected a finite number, got {text!r}")
        if (value <= low if low_open else value < low) or (high is not None and value > high):
            _fail(f"must be {wanted}, got {text}")
        return value

    return parse


def mib_or_auto(value):
    """MiB >= 0, or "auto" (None)."""
    if value is None or value == "auto":
        return None
    try:
        return number(0)(value)
    except argparse.ArgumentTypeError as exc:
        if "expected" in str(exc):
            _fail(f"expected a number of MiB or 'auto', got {value!r}")
        raise


def switch(value):
    """A bool, from 1 / 0 (the environment) or True / False."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip() in ("0", "1"):
        return value.strip() == "1"
    _fail(f"expected 0 or 1, got {value!r}")


class choice:
    """One of `choices`; fold: case and surrounding blanks do not matter."""

    def __init__(self, *choices, fold=False):
        self.choices, self.fold = choices, fold

    def __call__(self, value):
        key = value.strip().lower() if self.fold and isinstance(value, str) else value
        if key not in self.choices:
            _fail(f"expected one of {', '.join(self.choices)}, got {value!r}")
        return key


def text(value):
    if not isinstance(value, str):
        _fail(f"expected text, got {value!r}")
    return value


def setting(default, parse, help, env=None, flag=None):
    """A field of EngineConfig: `parse` turns env text or a given value into the setting (None stays None:
    unset), raising argparse.ArgumentTypeError with what was expected."""
    return field(default=default, metadata=dict(parse=parse, help=help, env=env, flag=flag))


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (None: the part's own default, said in the help). EngineConfig(...) holds the
    defaults and the values given; EngineConfig.resolve(...) adds the environment."""

    # where and how big
    device: str = setting("cpu", choice(*DEVICES), "where the model runs: auto (the GPU when usable, else the CPU), "
                          "gpu, cpu (default cpu; the CLI's default is auto)", flag="--device")
    max_context: int = setting(None, integer(1), "context limit per sequence (default: the model's; more is an "
                               "error)", env="STRATA_MAX_CONTEXT", flag="--max-context")
    kv_sequences: int = setting(1, integer(1), "sequences whose KV the memory holds (the server's --parallel)")
    kv: str = setting("f32", choice(*KV_DTYPES), "KV cache encoding: f32 (exact), f16 / bf16 (half the bytes, "
                      "~1e-3 / ~1e-2 off), int8 with per-token, per-head scales (a quarter, ~1e-2 off)",
                      flag="--kv")
    # CPU
    threads: int = setting(None, integer(1), "Numba worker threads (default: all cores)", env="STRATA_THREADS",
                           flag="--threads")
    isa_floor: str = setting("native", choice(*ISA_FLOORS, fold=True), "compile kernels for an older CPU than this "
                             "one (e.g. avx for Ivy Bridge Xeons); applied when hybrid is imported",
                             env="STRATA_ISA_FLOOR")
    act_quant: str = setting(None, choice(*ACT_QUANTS, fold=True), "how matmuls of quantized weights multiply: "
                             "int16 (CPU default), float or int8 (default: int16 on the CPU, auto on the GPU)",
                             env="STRATA_ACT_QUANT")
    prefetch_rows: int = setting(None, integer(0, 1024), "rows ahead the decode dots prefetch (default: timed at "
                                 "start-up)", env="STRATA_PREFETCH_ROWS")
    compiled_decode: bool = setting(True, switch, "CPU decode layers as one compiled call each (1) or op by op (0)",
                                    env="STRATA_COMPILED_DECODE")
    fused_decode: bool = setting(None, switch, "a compiled decode layer as one parallel region (1) or a region "
                                 "per op (0) (default: 1 from 2 threads on)", env="STRATA_FUSED_DECODE")
    cache_dir: str = setting(None, text, "where the demo model is cached (default ~/.cache/strata)",
                             env="STRATA_CACHE_DIR")
    # GPU
    expert_cache_mib: float = setting(None, mib_or_auto, "VRAM for resident experts (default auto: all that is "
                                      "left)", flag="--expert-cache-mib")
    vram_reserve_mib: float = setting(DEFAULT_RESERVE_MIB, number(0), f"VRAM left free as headroom (default "
                                      f"{DEFAULT_RESERVE_MIB})", flag="--vram-reserve-mib")
    expert_cache: str = setting("auto", choice(*EXPERT_CACHE_MODES), "auto: the experts of --placement, or planned "
                                "from --profile, or the cache filled layer by layer; dynamic: swap experts while "
                                "serving (default auto)", flag="--expert-cache")
    prefill_borrow: bool = setting(True, switch, "large prompt chunks may copy non-resident experts to the GPU",
                                   flag="--no-prefill-borrow")
    kv_resident: int = setting(None, integer(1), "GPU: only the newest N tokens of each slot's KV in VRAM, the "
                               "older ones in pinned RAM (default: all in VRAM)", flag="--kv-resident")
    kv_host_attention: str = setting("gpu", choice(*KV_HOST_ATTENTION), "with --kv-resident: who attends the KV in "
                                     "RAM: gpu (copied layer by layer, default) or cpu", flag="--kv-host-attention")
    decode_relay: bool = setting(True, switch, "a decode token's CPU experts handed over through mapped host memory "
                                 "(1) or run by the serving thread (0)", env="STRATA_DECODE_RELAY")
    relay_tokens: int = setting(1, integer(1), "decode steps of up to N tokens go through the relay",
                                env="STRATA_DECODE_RELAY_TOKENS")
    relay_threads: int = setting(None, integer(1), "Numba threads of the relay worker's CPU experts (default: "
                                 "--threads)", env="STRATA_RELAY_THREADS")
    prefill_cpu_share: float = setting(None, number(0, 1), "share of a prompt chunk's expert work kept on the CPU "
                                       "(default: from the cost model)", env="STRATA_PREFILL_CPU_SHARE")
    decode_graphs: bool = setting(True, switch, "a decode token's expert launches as one captured graph (1) or one "
                                  "by one (0)", env="STRATA_DECODE_GRAPHS")
    dense_graphs: bool = setting(True, switch, "a decode layer's dense launches as two captured graphs (1) or one "
                                 "by one (0)", env="STRATA_DENSE_GRAPHS")
    # server
    model: str = setting(None, text, "GGUF file or HF safetensors directory (default: the built-in demo model)",
                         env="STRATA_MODEL", flag="--model")
    parallel: int = setting(1, integer(1), "slots: requests served at once", env="STRATA_PARALLEL",
                            flag="--parallel")
    max_queue: int = setting(None, integer(1), "waiting requests beyond which the server answers 429 (default 16 "
                             "per slot)", env="STRATA_MAX_QUEUE", flag="--max-queue")
    decode_share: float = setting(DEFAULT_DECODE_SHARE, number(0, 1, low_open=True), "share of a decoding slot's "
                                  "rate kept while another slot reads a prompt", env="STRATA_BATCH_DECODE_SHARE",
                                  flag="--decode-share")
    api_key: str = setting(None, text, "require 'Authorization: Bearer KEY' on /v1", env="STRATA_API_KEY",
                           flag="--api-key")
    # placement planner (`strata plan`)
    cpu_gbps: float = setting(DEFAULT_CPU_GBPS, number(0, low_open=True), "CPU expert bandwidth in GB/s (measured)",
                              env="STRATA_CPU_GBPS", flag="--cpu-gbps")
    gpu_gbps: float = setting(DEFAULT_GPU_GBPS, number(0, low_open=True), "GPU memory bandwidth in GB/s",
                              env="STRATA_GPU_GBPS", flag="--gpu-gbps")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _parsed(f, value, f.name))

    @classmethod
    def resolve(cls, given=None, environ=None):
        """The config of `given` (flags or keywords; a None value: not given) over `environ` (default
        os.environ; empty values: unset) over the defaults."""
        environ = os.environ if environ is None else environ
        given = {k: v for k, v in (given or {}).items() if v is not None}
        unknown = sorted(set(given) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown setting {', '.join(unknown)}: expected one of {', '.join(SETTINGS)}")
        values = {}
        for name, f in SETTINGS.items():
            if name in given:
                values[name] = _parsed(f, given[name], name)
            elif f.metadata["env"] and environ.get(f.metadata["env"], "").strip():
                values[name] = _parsed(f, environ[f.metadata["env"]], f.metadata["env"])
        return cls(**values)

    def with_settings(self, **given):
        """This config with `given` settings replaced (None: kept)."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


def _parsed(f, value, source):
    try:
        return f.metadata["parse"](value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{source}: {exc}") from None


SETTINGS = {f.name: f for f in fields(EngineConfig)}


_applied_floor = None  # the ISA floor the kernels were imported for (apply_isa_floor)


def apply_isa_floor(environ=None):
    """Tell Numba the compile target of STRATA_ISA_FLOOR; hybrid/__init__.py calls it before any kernel
    module is imported, since they choose code by the target at import. Returns the floor."""
    global _applied_floor
    from cpu_kernels.target import apply_isa_floor as apply

    environ = os.environ if environ is None else environ
    floor = environ.get("STRATA_ISA_FLOOR", "").strip()
    _applied_floor = apply(_parsed(SETTINGS["isa_floor"], floor, "STRATA_ISA_FLOOR") if floor else "native")
    return _applied_floor


def check_isa_floor(config):
    """ValueError when `config` asks for another ISA floor than the one the kernels were imported for."""
    if _applied_floor is not None and config.isa_floor != _applied_floor:
        raise ValueError(f"isa_floor {config.isa_floor!r}: the kernels were imported for {_applied_floor!r}; "
                         f"set STRATA_ISA_FLOOR before importing hybrid")
