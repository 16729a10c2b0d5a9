"""The public Python API: `hybrid.LLM(path).generate(...)` and `.score(...)`."""
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from .backends import select_backends
from .backends.cpu import expert_work_bytes
from .backends.gpu import DEFAULT_RESERVE_MIB
from .batch import Batch, SeqChunk
from .expert_usage import ExpertUsage
from .formats import load_model
from .model import Model
from .request import StopFilter, check_prompt, end_reason, timings
from .residency import expert_cache_device, resident_choice
from .sampling import Sampler, SamplingParams
from .tokenizer import IncrementalDecoder

log = logging.getLogger(__name__)

PREFILL_CHUNK = 512  # prompt tokens per forward step: bounds the activations of a long prompt


def context_limit(requested, model_context, source):
    """The context to run at: `requested` (None: the model's), refused when the model holds less."""
    if requested is None:
        return model_context
    if not 1 <= requested <= model_context:
        raise ValueError(f"--max-context {requested}: {source} holds a context of 1 to {model_context} tokens "
                         f"(from its metadata)")
    return requested


@dataclass
class GenerationOutput:
    token_ids: list  # generated ids (the EOS that ended it included, as transformers does)
    text: str
    finish_reason: str  # "stop" (EOS or stop string) or "length"
    prompt_token_ids: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


class LLM:
    """device: "cpu", "gpu" or "auto" (the GPU when one is usable). With a GPU: expert_cache_mib
    (None = all VRAM left), vram_reserve_mib and kv_sequences (sequences whose KV the VRAM budget
    holds, also the batch a start-up plan is made for) size the VRAM. The resident experts
    (hybrid/residency.py): `placement` (a placement file or Placement), or `profile` (an
    ExpertProfile or its file: planned at start-up for the room left), or `resident` (a bool mask
    [L, E]); expert_cache "dynamic" swaps experts while serving (placement/dynamic.py, with
    `dynamic`: its DynamicSettings). prefill_borrow: large prompt chunks may run non-resident
    experts on the GPU (hybrid/moe.py). kv: the KV encoding; kv_resident / kv_host_attention: see
    GpuBackend (only the newest kv_resident positions of a sequence in VRAM)."""

    def __init__(self, model_path=None, device="cpu", threads=None, max_context=None, expert_cache_mib=None,
                 vram_reserve_mib=DEFAULT_RESERVE_MIB, resident=None, kv_sequences=1, placement=None, profile=None,
                 expert_cache="auto", dynamic=None, prefill_borrow=True, kv="f32", kv_resident=None,
                 kv_host_attention="gpu"):
        from cpu_kernels.target import set_threads

        device = expert_cache_device(device, placement, profile, expert_cache, expert_cache_mib)
        if model_path is None:
            from .demo import demo_config, demo_model_path

            context_limit(max_context, demo_config(vocab_size=0).context_length, "the demo model")  # before building it
            model_path = demo_model_path()
            log.warning("no model given: using the built-in demo model (RANDOM weights, its text is gibberish)")
        self.threads = set_threads(threads)
        self.weights = load_model(model_path)
        self.tokenizer = self.weights.tokenizer
        self.config = self.weights.config
        self.max_context = context_limit(max_context, self.config.context_length, self.weights.source)
        if device != "cpu" and resident is None:
            resident = resident_choice(self.weights, placement, profile, expert_cache, kv_sequences, self.max_context)
        backend, host = select_backends(device, expert_cache_mib=expert_cache_mib, vram_reserve_mib=vram_reserve_mib,
                                        kv_sequences=kv_sequences, max_context=self.max_context,
                                        chunk_tokens=PREFILL_CHUNK, resident=resident, prefill_borrow=prefill_borrow,
                                        kv_dtype=kv, kv_resident=kv_resident, kv_host_attention=kv_host_attention)
        self.device = backend.name
        if kv_resident is not None and self.device == "cpu":
            log.warning("--kv-resident does nothing on the CPU: the whole KV is in RAM")
        self.model = Model(self.weights, backend, host, kv_dtype=kv, kv_tokens=kv_sequences * self.max_context)
        if expert_cache == "dynamic" and self.device != "cpu":
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

        cache = getattr(self.model.backend, "cache", None)
        if cache is None:
            log.warning("--expert-cache dynamic needs a GPU expert cache; on %s it does nothing", self.device)
            return
        self.model.residency = DynamicResidency(cache, settings or DynamicSettings(), self.model.backend.stream)
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
        """Read `ids` into `kv` chunk by chunk; returns the logits the chunks asked for."""
        outputs = []
        for lo in range(0, len(ids), PREFILL_CHUNK):
            chunk = np.asarray(ids[lo : lo + PREFILL_CHUNK], dtype=np.int64)
            is_last = lo + PREFILL_CHUNK >= len(ids)
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

