"""Every engine and command setting, listed once: `EngineConfig`, resolved once from flags (or `LLM` keywords)
> the `STRATA_*` environment > the config file (hybrid/config_file.py) > defaults.

Each field carries in its metadata (`setting(...)`) its parser, help, the commands whose flag it is
(`generate`, `serve`, `profile`, `plan`), its README section, and where they differ from the derived ones its
variable (default `STRATA_<NAME>`) and flag (default `--<name>`). The CLI makes its flags from them
(hybrid/cli_options.py), the config file's keys are the field names, `LLM(...)` and the server resolve the
same way, and the README's settings table is generated from them (hybrid/config_doc.py, checked by
tests/hybrid/test_config.py). A new setting is one field here. This is the only module that reads the
environment; the parts below receive plain values.

Bad values are one line naming the flag, the keyword, the variable or the file line: "STRATA_THREADS:
expected an integer, got 'all'". This module imports nothing heavy: `hybrid/__init__.py` applies the ISA floor
from it before the kernels are imported.
"""
import argparse
import os
from dataclasses import dataclass, field, fields, replace

from .config_types import (checkpoint_interval, choice, count_or_auto, existing_file, gpu_list, gpu_mib,  # noqa: F401
                           integer, layer_split, mib_or_auto, number, output_file, switch, text)

ISA_FLOORS = ("avx", "avx2", "avx512", "native")  # cpu_kernels/target.py ISA_FLOORS
ACT_QUANTS = ("int16", "float", "int8")  # cpu_kernels/act_quant.py ACT_QUANTS
KV_DTYPES = ("f32", "f16", "bf16", "int8")  # hybrid/kv_store.py KV_DTYPES
PARKED_KV = ("f32", "f16", "int8")  # hybrid/kv_store.py STORES
DEVICES = ("auto", "gpu", "cpu")  # hybrid/backends DEVICES
EXPERT_CACHE_MODES = ("auto", "dynamic")  # hybrid/residency.py
KV_HOST_ATTENTION = ("gpu", "cpu")  # hybrid/backends/gpu.py
GEMM_MATHS = ("tf32x3", "tf32", "fp32")  # gpu_kernels/gemm.py GEMM_MATHS
DEFAULT_RESERVE_MIB = 512  # hybrid/backends/gpu.py DEFAULT_RESERVE_MIB
DEFAULT_DECODE_SHARE = 0.8  # hybrid/scheduler.py DEFAULT_DECODE_SHARE
DEFAULT_CPU_GBPS = 40.0  # placement/planner.py
DEFAULT_GPU_GBPS = 3000.0  # placement/planner.py
DEFAULT_MAX_BODY_MIB = 8.0  # server/body.py DEFAULT_MAX_BODY_BYTES
DEFAULT_MAX_CONNECTIONS = 100  # server/options.py: waitress's own

COMMANDS = ("generate", "serve", "profile", "plan")
RUN = ("generate", "serve")  # the commands that run the engine on a GPU or the CPU
LOAD = ("generate", "serve", "profile")  # the commands that load the model to run it
SECTIONS = {"server": "server", "conversation": "conversation cache", "kv": "KV cache", "cpu": "CPU",
            "gpu": "GPU", "dynamic": "dynamic expert cache", "plan": "profile and plan"}


def setting(default, parse, help, section, commands=(), env=None, flag=None, metavar=None, cli_default=None,
            internal=False):
    """A field of EngineConfig: `parse` turns env text or a given value into the setting (None stays None:
    unset), raising argparse.ArgumentTypeError with what was expected. commands: those with a flag for it;
    env / flag: a name other than STRATA_<NAME> / --<name>; cli_default: the commands' default where it is
    not the library's; internal: set by the program (no flag, variable or file key)."""
    return field(default=default, metadata=dict(parse=parse, help=help, section=section, commands=commands, env=env,
                                                flag=flag, metavar=metavar, cli_default=cli_default,
                                                internal=internal))


@dataclass(frozen=True)
class EngineConfig:
    """The engine's and the commands' settings (None: the part's own default, said in the help).
    EngineConfig(...) holds the defaults and the values given; EngineConfig.resolve(...) adds the environment
    and the config file."""

    # where and how big
    device: str = setting("cpu", choice(*DEVICES), "where the model runs: auto (the GPU when usable, else the "
                          "CPU), gpu, cpu (default cpu in Python; the commands' default is auto)", "gpu", RUN,
                          cli_default="auto")
    max_context: int = setting(None, integer(1), "context limit per slot (default: the model's; more is an "
                               "error)", "server", LOAD + ("plan",), metavar="N")
    kv_sequences: int = setting(1, integer(1), "sequences whose KV the memory holds (the server's --parallel)",
                                "kv", internal=True)
    kv: str = setting("f32", choice(*KV_DTYPES), "KV cache encoding: f32 (exact), f16 / bf16 (half the bytes, "
                      "~1e-3 / ~1e-2 off), int8 with per-token, per-head scales (a quarter, ~1e-2 off)", "kv",
                      RUN + ("plan",))
    # CPU
    threads: int = setting(None, integer(1), "Numba worker threads (default: all cores)", "cpu", LOAD, metavar="N")
    isa_floor: str = setting("native", choice(*ISA_FLOORS, fold=True), "compile kernels for an older CPU than this "
                             "one (e.g. avx for Ivy Bridge Xeons); applied when hybrid is imported", "cpu")
    act_quant: str = setting(None, choice(*ACT_QUANTS, fold=True), "how matmuls of quantized weights multiply: "
                             "int16 (CPU default), float or int8 (default: int16 on the CPU, auto on the GPU)", "cpu")
    prefetch_rows: int = setting(None, integer(0, 1024), "rows ahead the decode dots prefetch (default: timed at "
                                 "start-up)", "cpu")
    compiled_decode: bool = setting(True, switch, "CPU decode layers as one compiled call each (1) or op by op (0)",
                                    "cpu")
    fused_decode: bool = setting(None, switch, "a compiled decode layer as one parallel region (1) or a region "
                                 "per op (0) (default: 1 from 2 threads on)", "cpu")
    cache_dir: str = setting(None, text, "where the demo model is cached (default ~/.cache/strata)", "cpu")
    # GPU
    expert_cache_mib: float = setting(None, mib_or_auto, "VRAM for resident experts (default auto: all that is "
                                      "left)", "gpu", RUN, metavar="N|auto")
    vram_reserve_mib: float = setting(DEFAULT_RESERVE_MIB, number(0), f"VRAM left free as headroom (default "
                                      f"{DEFAULT_RESERVE_MIB})", "gpu", RUN + ("plan",), metavar="N")
    expert_cache: str = setting("auto", choice(*EXPERT_CACHE_MODES), "auto: the experts of --placement, or planned "
                                "from --profile, or the cache filled layer by layer; dynamic: swap experts while "
                                "serving (default auto)", "gpu", RUN)
    placement: str = setting(None, existing_file, "resident experts from `strata plan` (placement.json); refused if "
                             "it does not fit", "gpu", RUN, metavar="FILE")
    profile: str = setting(None, existing_file, "expert profile (`strata profile`) to plan the expert cache from "
                           "(at start-up; `strata plan`: the profile it plans from)", "gpu", RUN + ("plan",),
                           metavar="P.npz")
    prefill_borrow: bool = setting(True, switch, "large prompt chunks may copy non-resident experts to the GPU "
                                   "(prefill borrow; --no-prefill-borrow: never)", "gpu", RUN,
                                   flag="--no-prefill-borrow")
    kv_resident: int = setting(None, integer(1), "GPU: only the newest N tokens of each slot's KV in VRAM, the "
                               "older ones in pinned RAM (default: all in VRAM)", "kv", RUN + ("plan",), metavar="N")
    kv_host_attention: str = setting("gpu", choice(*KV_HOST_ATTENTION), "with --kv-resident: who attends the KV in "
                                     "RAM: gpu (copied layer by layer, default) or cpu", "kv", RUN)
    decode_relay: bool = setting(True, switch, "a decode token's CPU experts handed over through mapped host memory "
                                 "(1) or run by the serving thread (0)", "gpu")
    relay_tokens: int = setting(1, integer(1), "decode steps of up to N tokens go through the relay", "gpu",
                                env="STRATA_DECODE_RELAY_TOKENS")
    relay_threads: int = setting(None, integer(1), "Numba threads of the relay worker's CPU experts (default: "
                                 "--threads)", "gpu")
    relay_graphs: bool = setting(True, switch, "with step graphs, a decode step whose CPU experts go through the "
                                 "relay as one captured graph, waiting on the CPU's rows inside it (1), or layer by "
                                 "layer (0)", "gpu")
    prefill_cpu_share: float = setting(None, number(0, 1), "share of a prompt chunk's expert work kept on the CPU "
                                       "(default: from the cost model)", "gpu")
    decode_graphs: bool = setting(True, switch, "a decode token's expert launches as one captured graph (1) or one "
                                  "by one (0)", "gpu")
    dense_graphs: bool = setting(True, switch, "a decode layer's dense launches as two captured graphs (1) or one "
                                 "by one (0)", "gpu")
    step_graphs: bool = setting(True, switch, "with dense graphs, a decode step whose experts are all resident as one "
                                "captured graph (1) or layer by layer (0)", "gpu")
    solo_chunk_tokens: int = setting(2048, integer(1), "GPU holding every expert: prompt tokens a step reads while no "
                                     "slot decodes, where VRAM holds their activations (fewer, fuller expert tiles; a "
                                     "user arriving mid-read waits up to one such step)", "gpu", metavar="N")
    gemm_math: str = setting("tf32x3", choice(*GEMM_MATHS, fold=True), "how a prompt chunk's GPU matmuls "
                             "and attention multiply (NVIDIA sm_80+): tf32x3 (tensor cores, each operand split in two "
                             "TF32 parts: float32-like, default), tf32 (one TF32 product: faster, ~3e-4 off) or fp32 "
                             "(float32 FMA; the attention's kernel before tensor cores)", "gpu")
    gpus: tuple = setting(None, gpu_list, "GPUs to run on, each a pipeline stage of consecutive layers (--layer-split); "
                          "an index given twice is one GPU presented as two logical devices, each with half its free "
                          "memory (default: every visible GPU)", "gpu", RUN, metavar="I[,I]")
    trim_stage_weights: bool = setting(None, switch, "with several GPUs, host RAM copies only the experts some stage "
                                       "runs on the CPU, not those every device holds (default: on when the model "
                                       "takes over half of the available RAM)", "gpu", RUN)
    batch_groups: object = setting("auto", count_or_auto, "with several GPUs, decoding slots move through the stages "
                                   "in N groups, so that the devices and the CPU work at once (auto: one group per "
                                   "stage when there are as many slots; 1: every slot together, stage after stage)",
                                   "gpu", ("serve",), metavar="auto|N")
    # dynamic expert cache (--expert-cache dynamic; placement/dynamic.py SETTING_LIMITS)
    dynamic_decay: float = setting(None, number(0, 1, low_open=True), "per-step decay of an expert's usage score, "
                                   "in (0, 1] (default 0.98)", "dynamic", RUN, metavar="DECAY")
    dynamic_margin: float = setting(None, number(0), "hysteresis: a newcomer's score must exceed (1 + MARGIN) x "
                                    "the evicted expert's ... (default 0.5)", "dynamic", RUN, metavar="MARGIN")
    dynamic_min_score: float = setting(None, number(0), "... plus this many (decayed) routings (default 2.0)",
                                       "dynamic", RUN, metavar="MIN_SCORE")
    dynamic_max_swaps: int = setting(None, integer(1), "swaps started per step, over all layers (default 2)",
                                     "dynamic", RUN, metavar="MAX_SWAPS")
    dynamic_max_pending: int = setting(None, integer(1), "swaps in flight at once, pinned staging buffers "
                                       "(default 8)", "dynamic", RUN, metavar="MAX_PENDING")
    # server
    model: str = setting(None, text, "GGUF file or HF safetensors directory (default: the built-in demo model)",
                         "server", COMMANDS, metavar="PATH")
    parallel: int = setting(1, integer(1), "slots: requests served at once (`strata plan`: the planned decode "
                            "batch)", "server", ("serve", "plan"), metavar="N")
    host: str = setting("127.0.0.1", text, "address to listen on (default 127.0.0.1)", "server", ("serve",))
    port: int = setting(8080, integer(1, 65535), "port, 1..65535 (default 8080)", "server", ("serve",))
    api_key: str = setting(None, text, "require 'Authorization: Bearer KEY' on /v1", "server", ("serve",),
                           metavar="KEY")
    max_queue: int = setting(None, integer(1), "waiting requests beyond which the server answers 429 (default 16 "
                             "per slot)", "server", ("serve",), metavar="N")
    decode_share: float = setting(DEFAULT_DECODE_SHARE, number(0, 1, low_open=True), "share of a decoding slot's "
                                  "rate kept while another slot reads a prompt", "server", ("serve",),
                                  env="STRATA_BATCH_DECODE_SHARE", metavar="F")
    spec: int = setting(4, integer(0, 16), "speculative decoding: at most K draft tokens per slot and step, scored "
                        "in the step's batch (0: off; requests with a grammar never draft)", "server", ("serve",),
                        metavar="K")
    spec_ngram: int = setting(3, integer(1, 8), "drafts follow the longest of the last 1..N tokens seen before in "
                              "the slot's prompt and output (prompt lookup)", "server", ("serve",), metavar="N")
    spec_min_p: float = setting(0.5, number(0, 1), "stop drafting where the drafter's confidence falls below P",
                                "server", ("serve",), metavar="P")
    mtp: bool = setting(False, switch, "drafts from the model's MTP / NextN layer (glm4moe, qwen3next, qwen35moe "
                        "files that have one) instead of n-gram lookup", "server", ("serve",))
    max_body_mib: float = setting(DEFAULT_MAX_BODY_MIB, number(0, low_open=True), "largest request body in MiB; a "
                                  "larger one is refused with 413 before it is read", "server", ("serve",),
                                  metavar="MIB")
    max_connections: int = setting(None, integer(1), f"client connections open at once; more wait in the OS's "
                                   f"accept queue (default {DEFAULT_MAX_CONNECTIONS}, or --parallel + --max-queue "
                                   f"when that is more: every admitted request holds one)", "server", ("serve",),
                                   metavar="N")
    profile_out: str = setting(None, output_file, "on shutdown, save the expert usage seen while serving as an "
                               "ExpertProfile (.npz; merged into the file if it exists)", "server", ("serve",),
                               metavar="P.npz")
    # conversation cache
    conversation_cache_mib: int = setting(2048, integer(0), "RAM for parked conversations in MiB, 0 turns the "
                                          "cache off", "conversation", ("serve",), metavar="MIB")
    conversation_cache_slots: int = setting(None, integer(1), "most conversations kept (default: no limit, only "
                                            "the MiB budget evicts)", "conversation", ("serve",), metavar="N")
    conversation_cache_kv: str = setting("f32", choice(*PARKED_KV), "how parked KV is stored: f32 as read "
                                         "(exact), f16 (half the bytes, ~1e-3 off), int8 (a quarter, ~1e-2 off)",
                                         "conversation", ("serve",))
    conversation_cache_dir: str = setting(None, text, "also keep parked conversations in this folder so that they "
                                          "survive a restart", "conversation", ("serve",), metavar="DIR")
    conversation_checkpoint_tokens: int = setting(1024, checkpoint_interval, "linear-attention models (Qwen3-Next): "
                                                  "their recurrent state is also kept every this many tokens (a "
                                                  "multiple of 64), so that a conversation whose history differs "
                                                  "from a parked one restores up to the last checkpoint before the "
                                                  "difference", "conversation", ("serve",), metavar="N")
    # placement planner (`strata plan`)
    gpu_mib: tuple = setting(None, gpu_mib, "memory per GPU in MiB, comma-separated: 24000 or 24000,24000", "plan",
                             ("plan",), metavar="MIB[,MIB]")
    layer_split: object = setting("auto", layer_split, "auto, or the first layer of each GPU after the first (e.g. "
                                  "24 for 2 GPUs); running: auto takes the placement's split, else cuts in "
                                  "proportion to each GPU's free memory", "plan", RUN + ("plan",),
                                  metavar="auto|L[,L]")
    cpu_gbps: float = setting(DEFAULT_CPU_GBPS, number(0, low_open=True), "CPU expert bandwidth in GB/s (measured)",
                              "plan", ("plan",), metavar="GBPS")
    gpu_gbps: float = setting(DEFAULT_GPU_GBPS, number(0, low_open=True), "GPU memory bandwidth in GB/s", "plan",
                              ("plan",), metavar="GBPS")

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _parsed(f, value, f.name))

    @classmethod
    def resolve(cls, given=None, environ=None, file=None, defaults=None):
        """The config of `given` (flags or keywords; a None value: not given) over `environ` (default
        os.environ; empty values: unset) over `file` over `defaults` (see resolve_sources)."""
        return resolve_sources(given, environ, file, defaults)[0]

    def with_settings(self, **given):
        """This config with `given` settings replaced (None: kept)."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


def _parsed(f, value, source):
    try:
        return f.metadata["parse"](value)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{source}: {exc}") from None


SETTINGS = {f.name: f for f in fields(EngineConfig)}


def env_var(name):
    """The STRATA_* variable of setting `name` (None for an internal one)."""
    meta = SETTINGS[name].metadata
    return None if meta["internal"] else meta["env"] or "STRATA_" + name.upper()


def flag_of(name):
    """The flag of setting `name` (None when no command has one)."""
    meta = SETTINGS[name].metadata
    return meta["flag"] or ("--" + name.replace("_", "-") if meta["commands"] else None)


def file_settings():
    """The settings a config file may hold: every one but the internal ones."""
    return [name for name, f in SETTINGS.items() if not f.metadata["internal"]]


def resolve_sources(given=None, environ=None, file=None, defaults=None, flags=False):
    """(EngineConfig, {name: source}) of `given` (flags or keywords; a None value: not given) over `environ`
    (default os.environ; a blank value: unset) over `file` ({name: (value, where)}: a config file's values,
    hybrid/config_file.py) over `defaults` ({name: value}: the commands' own defaults) over the fields' defaults.
    A source is the flag (flags) or keyword, the variable, the file's place, "default (command)" or "default"."""
    environ = os.environ if environ is None else environ
    given = {k: v for k, v in (given or {}).items() if v is not None}
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise TypeError(f"unknown setting {', '.join(unknown)}: expected one of {', '.join(SETTINGS)}")
    values, sources = {}, {}
    for name, f in SETTINGS.items():
        var = env_var(name)
        if name in given:
            values[name], sources[name] = _parsed(f, given[name], name), flag_of(name) if flags else name
        elif var and environ.get(var, "").strip():
            values[name], sources[name] = _parsed(f, environ[var], var), var
        elif file and name in file:
            value, where = file[name]
            values[name], sources[name] = _parsed(f, value, f"{where}: {name}"), where
        elif defaults and defaults.get(name) is not None:
            values[name], sources[name] = defaults[name], "default (command)"
        else:
            sources[name] = "default"
    return EngineConfig(**values), sources


_applied_floor = None  # the ISA floor the kernels were imported for (apply_isa_floor)


def apply_isa_floor(file_floor=None, environ=None):
    """Tell Numba the compile target of STRATA_ISA_FLOOR, else of `file_floor` (the config file's isa_floor:
    hybrid.config_file.file_isa_floor), else native; hybrid/__init__.py calls it before any kernel module is
    imported, since they choose code by the target at import. Returns the floor."""
    global _applied_floor
    from cpu_kernels.target import apply_isa_floor as apply

    environ = os.environ if environ is None else environ
    floor = environ.get("STRATA_ISA_FLOOR", "").strip()
    if floor:
        _applied_floor = apply(_parsed(SETTINGS["isa_floor"], floor, "STRATA_ISA_FLOOR"))
    else:
        _applied_floor = apply(file_floor or "native")
    return _applied_floor


def check_isa_floor(config):
    """ValueError when `config` asks for another ISA floor than the one the kernels were imported for."""
    if _applied_floor is not None and config.isa_floor != _applied_floor:
        raise ValueError(f"isa_floor {config.isa_floor!r}: the kernels were imported for {_applied_floor!r}; "
                         f"set STRATA_ISA_FLOOR (or isa_floor in $STRATA_CONFIG's file) before importing hybrid")
