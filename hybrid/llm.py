"""The public Python API: `hybrid.LLM(path).generate(...)` and `.score(...)`."""
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .backends import select_backends
from .backends.cpu import expert_work_bytes
from .batch import Batch, SeqChunk
from .config import EngineConfig, check_isa_floor
from .expert_usage import ExpertUsage
from .formats import load_model
from .model import Model, solo_chunk_tokens
from .request import StopFilter, check_prompt, context_limit, end_reason, timings
from .devices import stage_gpus
from .residency import expert_cache_device, resident_choice
from .sampling import Sampler, SamplingParams
from .split_settings import SplitSettings
from .tokenizer import IncrementalDecoder
from .weight_formats import check_supported

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per forward step: bounds the activations of a long prompt


def cpu_options(cfg):
    """CpuBackend's keywords of an EngineConfig."""
    return dict(fused_decode=cfg.fused_decode, act_quant=cfg.act_quant, prefetch_rows=cfg.prefetch_rows)


def gpu_options(cfg, max_context, resident):
    """GpuBackend's keywords of an EngineConfig, for a context of max_context tokens and a resident mask."""
    return dict(expert_cache_mib=cfg.expert_cache_mib, vram_reserve_mib=cfg.vram_reserve_mib,
                kv_sequences=cfg.kv_sequences, max_context=max_context, chunk_tokens=PREFILL_CHUNK,
                resident=resident, prefill_borrow=cfg.prefill_borrow, kv_dtype=cfg.kv, kv_resident=cfg.kv_resident,
                kv_host_attention=cfg.kv_host_attention, decode_graphs=cfg.decode_graphs,
                dense_graphs=cfg.dense_graphs, step_graphs=cfg.step_graphs, act_quant=cfg.act_quant or "auto",
                gemm_math=cfg.gemm_math, solo_chunk_tokens=cfg.solo_chunk_tokens)


def split_settings(cfg):
    return SplitSettings(cpu_share=cfg.prefill_cpu_share, decode_relay=cfg.decode_relay,
                         relay_tokens=cfg.relay_tokens, relay_threads=cfg.relay_threads,
                         relay_graphs=cfg.relay_graphs)


@dataclass
class GenerationOutput:
    token_ids: list  # generated ids (the EOS that ended it included, as transformers does)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_token_ids: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


class LLM:
    """A model ready to generate. Settings (hybrid/config.py EngineConfig): `config`, with keyword settings
    (device="gpu", threads=4, kv="f16", ...) over it; without `config`, the keywords over the STRATA_*
    environment over the defaults. model_path None: the config's model, else the built-in demo model.
    The resident experts (hybrid/residency.py): `placement` (a placement file or Placement), or `profile`
    (an ExpertProfile or its file: planned at start-up for the room left), or `resident` (a bool mask
    [L, E]); expert_cache "dynamic" swaps experts while serving (placement/dynamic.py, with `dynamic`: its
    DynamicSettings)."""

    def __init__(self, model_path=None, config=None, *, resident=None, placement=None, profile=None, dynamic=None,
                 **settings):
        from cpu_kernels.target import set_threads

        cfg = config.with_settings(**settings) if config is not None else EngineConfig.resolve(settings)
        check_isa_floor(cfg)
        self.settings = cfg
        device = expert_cache_device(cfg.device, placement, profile, cfg.expert_cache, cfg.expert_cache_mib)
        model_path = model_path or cfg.model
        if model_path is None:
            from .demo import demo_config, demo_model_path

            demo_context = demo_config(vocab_size=0).context_length
            context_limit(cfg.max_context, demo_context, "the demo model")  # before building it
            model_path = demo_model_path(cfg.cache_dir)
            log.warning("no model given: using the built-in demo model (RANDOM weights, its text is gibberish)")
        self.threads = set_threads(cfg.threads)
        self.weights = load_model(model_path)
        check_supported(self.weights)
        log.info("model types by bytes: %s", self.weights.type_mix())
        self.tokenizer = self.weights.tokenizer
        self.config = self.weights.config
        self.max_context = context_limit(cfg.max_context, self.config.context_length, self.weights.source)
        gpus = stage_gpus(cfg, device)
        if len(gpus) > 1:  # pipeline stages (hybrid/staged_model.py)
            from .staged_model import build_staged

            self.model = build_staged(self.weights, cfg, gpus, lambda mask: gpu_options(cfg, self.max_context, mask),
                                      cpu_options(cfg), split_settings(cfg), resident, placement, profile,
                                      self.max_context)
            backend, host, self.device = self.model.backend, None, "gpu"
        else:
            if device != "cpu" and resident is None:
                resident = resident_choice(self.weights, placement, profile, cfg.expert_cache, cfg.kv_sequences,
                                           self.max_context)
            backend, host = select_backends(device, cpu_options(cfg), gpu_options(cfg, self.max_context, resident))
            self.device = backend.name
            if cfg.kv_resident is not None and self.device == "cpu":
                log.warning("--kv-resident does nothing on the CPU: the whole KV is in RAM")
            self.model = Model(self.weights, backend, host, kv_dtype=cfg.kv,
                               kv_tokens=cfg.kv_sequences * self.max_context, compiled_decode=cfg.compiled_decode,
                               split=split_settings(cfg))
        if cfg.expert_cache == "dynamic" and self.device != "cpu":
            self._start_dynamic(dynamic)
        log.info("model %s on %s, %d CPU threads, context %d; %s", self.weights.source, self.device, self.threads,
                 self.max_context, backend.describe_kv(self.model.kv_pool, self.max_context))
        if host is not None or self.device == "cpu":
            c = self.config
            work = expert_work_bytes(PREFILL_CHUNK, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size)
            log.info("CPU expert work arrays: up to %.0f MiB per thread that runs experts (a %d-token step), "
                     "kept between steps", work / 2**20, PREFILL_CHUNK)

    def _start_dynamic(self, settings):
        from placement.dynamic import DynamicResidency, DynamicSettings

        if not self.model.backend.capabilities.expert_cache:
            log.warning("--expert-cache dynamic needs a GPU expert cache; on %s it does nothing", self.device)
            return
        backend = self.model.backend
        self.model.residency = DynamicResidency(backend.cache, settings or DynamicSettings(), backend.stream)
        if self.model.usage is None:  # the engine brings its own; the residency follows model.usage
            self.model.usage = ExpertUsage.for_config(self.config)
        log.info("expert cache: dynamic, %s", self.model.residency.policy.settings)

    def close(self):
        """Stop the engine threads the model started (hybrid MoE workers); `with LLM(...) as llm:` calls it."""
        self.model.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def warm_up(self, progress=True):
        """Run the steps a request can take (hybrid/warm_up.py) on scratch sequences, so that every kernel
        variant a request needs is compiled (or loaded from Numba's cache) before the first one arrives, and
        renders the chat template once; the model's usage profile and dynamic expert cache do not see it.
        progress: a bar on stderr naming the step and the kernel being compiled. Returns the seconds it took."""
        from .scheduler import DEFAULT_STEP_TOKENS
        from .warm_up import long_chunk_tokens, warm_chat_template, warm_up

        step_tokens = max(PREFILL_CHUNK, DEFAULT_STEP_TOKENS)
        long_tokens = long_chunk_tokens(self.model.backend, self.config, step_tokens, self.max_context)
        warm_chat_template(self.tokenizer)
        return warm_up(self.model, long_tokens, progress)

    def _prompt_ids(self, prompt):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        check_prompt(ids, self.max_context, self.config.vocab_size)
        return ids

    def _prefill(self, ids, kv, logits="last"):
        """Read `ids` into `kv` chunk by chunk (the backend's solo_chunk_tokens a chunk where it has them and the last
        logits are all that is asked); returns the logits the chunks asked for."""
        solo = solo_chunk_tokens(self.model) if logits == "last" else None
        step, outputs = max(PREFILL_CHUNK, solo or 0), []
        for lo in range(0, len(ids), step):
            chunk = np.asarray(ids[lo : lo + step], dtype=np.int64)
            is_last = lo + step >= len(ids)
            want = logits if (logits == "all" or is_last) else "none"
            outputs.append(self.model.forward(Batch([SeqChunk(kv, kv.length, chunk, want)])))
        return np.concatenate(outputs)

    def score(self, token_ids):
        """Logits at every position: float32 [T, vocab]."""
        ids = self._prompt_ids(list(token_ids))
        return self._prefill(ids, self.model.new_sequence(self.max_context), logits="all")

    def generate(self, prompt, max_tokens=256, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                 seed=None, stop=None, ignore_eos=False):
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                min_p=min_p, seed=seed, stop=list(stop or []), ignore_eos=ignore_eos)
        return self.generate_with(prompt, params)

    def chat(self, messages, **sampling):
        """Render `messages` with the model's chat template (special-token text in them stays text), then
        generate."""
        return self.generate(self.tokenizer.encode_chat(messages), **sampling)

    def generate_with(self, prompt, params):
        params.validate()
        ids = self._prompt_ids(prompt)
        kv = self.model.new_sequence(self.max_context)
        t0 = time.perf_counter()
        logits = self._prefill(ids, kv)[-1]
        t1 = time.perf_counter()
        out_ids, text, finish = self._decode(logits, kv, params)
        t2 = time.perf_counter()
        return GenerationOutput(out_ids, text, finish, ids, timings(len(ids), t1 - t0, len(out_ids), t2 - t1))

    def _decode(self, logits, kv, params):
        sampler, decoder, stops = Sampler(params), IncrementalDecoder(self.tokenizer), StopFilter(params.stop)
        out_ids, text = [], ""
        while True:
            token = sampler(logits)
            out_ids.append(token)
            reason = end_reason(token, len(out_ids), kv.length, params, self.tokenizer.eos_ids, self.max_context)
            if reason == "stop":  # an end token: not part of the text
                return out_ids, text + stops.flush(), reason
            piece, stopped = stops.push(decoder.push(token))
            text += piece
            if stopped:
                return out_ids, text, "stop"
            if reason == "length":
                return out_ids, text + stops.flush(), reason
            step = Batch([SeqChunk(kv, kv.length, np.asarray([token], dtype=np.int64))])
            logits = self.model.forward(step)[0]

