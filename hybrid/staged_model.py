"""One engine over several devices, each a pipeline stage (hybrid/stages.py says which layers): a stage's GpuBackend
holds its layers' dense weights, their KV and its expert cache; one host backend runs every stage's CPU experts.
A step's activations pass from stage to stage (`Link`: a peer copy where the devices allow it, else through pinned
host memory). The same code runs N physical GPUs, one GPU presented as N logical devices (hybrid/devices.py) and
N NumPy stand-in devices (gpu_kernels/numpy_runtime.py).

StagedModel offers what the engine, the scheduler and the server use of a Model (forward, new_sequence, config,
usage, backend, ...). Shape legend: T tokens, H hidden, V vocab, L layers, E experts.
"""
import contextlib
import logging
from dataclasses import dataclass, field, replace

import numpy as np

from gpu_kernels.errors import VramError

from .arch import ARCHS
from .batch import Batch
from .model import LAYER_NUMBERS, LayerWeights, _layer_weights, _nextn
from .moe import ExpertSplit
from .pipeline import Pipeline, chunk_groups, num_groups
from .recurrent_state import RecurrentShape
from .runners import choose_runner
from .stages import StagedKV, describe_split, hit_rates, trim_copies
from .weight_formats import dequantize

log = logging.getLogger(__name__)


def hollow(layer):
    """A layer's numbers without its weights: what a device that does not run it knows of it."""
    return LayerWeights(**{name: getattr(layer, name) for name in LAYER_NUMBERS if name not in ("expert_glu",
                                                                                                 "kv_index")})


def split_resident(resident, layer_range):
    """The stage's ExpertSplit's mask: its device's rows, every other stage's layer marked resident (the split reads
    only its own layers' rows; a step whose own experts are all resident may then be one graph)."""
    out = np.ones_like(resident)
    out[layer_range.start:layer_range.stop] = resident[layer_range.start:layer_range.stop]
    return out


@dataclass
class StageWeights:
    """What a stage's backend places (GpuBackend.place's view of a model): every layer, hollow outside the stage,
    so that masks and caches keep the model's layer numbers; the embedding on the first stage, the head on the
    last."""

    config: object
    layers: list
    num_kv_layers: int
    token_embd: object = None
    output: object = None
    output_norm: np.ndarray = None
    recurrent_shape: object = None


@dataclass
class Stage:
    """A device's part of the model: the layers it runs (the model's LayerWeights, their KV index the stage
    pool's), its backend, KV pool, expert split and runner. A runner runs a Stage as it runs a Model."""

    index: int
    layer_range: range
    backend: object
    config: object
    layers: list
    split: object = None
    kv_pool: object = None
    runner: object = None
    usage: object = None
    busy_s: float = 0.0  # device time of this stage's parts of the steps (timing events; 0 where they time nothing)
    events: list = field(default_factory=list)  # (start, stop) of its latest part, until added to busy_s

    def batch_of(self, batch):
        """The step's batch with each chunk's KV this stage's part."""
        return Batch([replace(chunk, kv=chunk.kv.parts[self.index]) for chunk in batch.chunks])


class Link:
    """Hands a step's activations [T, H] from one stage's device to the next: a peer copy queued on the receiving
    stream after the sender's work (the sender's later work waits for the copy), or, without peer access, a copy
    to pinned host memory and up again."""

    def __init__(self, src, dst):
        self.src, self.dst = src, dst
        self.peer = dst.rt.can_access_peer(src.rt)

    def describe(self):
        return "by peer copy" if self.peer else "through pinned host memory"

    def pass_on(self, x):
        """x [T, H] on the sender's device -> a copy on the receiver's, ordered on both streams."""
        src, dst = self.src, self.dst
        if not self.peer:
            view, done = src.staging.download("stage_out", x, src.stream)
            done.synchronize()
            dst.begin_step()
            return dst.staging.upload("stage_in", view, dst.stream)
        src.rt.use()
        sent = src.rt.event()
        sent.record(src.stream)
        dst.begin_step()
        dst.rt.wait_event(dst.stream, sent)
        out = dst.rt.empty(x.shape, x.dtype)  # [T, H]
        dst.rt.copy_peer_async(out, x, src.rt, dst.stream)
        copied = dst.rt.event()
        copied.record(dst.stream)
        src.rt.wait_event(src.stream, copied)  # x's memory is not reused by the sender before the copy read it
        return out


class StagedBackends:
    """The stages' backends as the server and the engine's logs see one: resident experts of every device, the
    KV of each, the first stage's capabilities."""

    name = "gpu"

    def __init__(self, stages):
        self.stages = stages
        self.capabilities = stages[0].backend.capabilities

    @property
    def resident(self):
        """bool [L, E]: the experts some device holds (each layer's on its stage's device)."""
        return np.logical_or.reduce([s.backend.resident for s in self.stages])

    def describe_kv(self, pool, max_tokens):
        return "; ".join(f"GPU stage {s.index}: {s.backend.describe_kv(s.kv_pool, max_tokens)}" for s in self.stages)


class StagedModel:
    """The model over `backends` (one per stage, each a GpuBackend) with `ranges` (its layers per stage) and the
    host backend `host` running non-resident experts. trim: the host copies into RAM only the rows of the experts
    it runs (stages.trim_copies), the rest stays mapped from the file. time_stages: record each stage's device time
    per step. batch_groups: --batch-groups (hybrid/pipeline.py num_groups)."""

    def __init__(self, weights, backends, ranges, host=None, kv_dtype="f32", compiled_decode=True, split=None,
                 trim=False, time_stages=True, batch_groups="auto"):
        self.weights, self.kv_dtype, self.config = weights, kv_dtype, weights.config
        self.spec = ARCHS[self.config.arch]
        c = self.config
        recipes = tuple(self.spec.layer_recipe(c, i) for i in range(c.num_layers))
        if RecurrentShape.of(recipes) is not None:
            raise ValueError(f"{c.arch}: linear-attention layers do not run over several GPUs yet; give --gpus with "
                             f"one GPU")
        self.recurrent_shape = None
        self.layers = [_layer_weights(weights, i, self.spec) for i in range(c.num_layers)]
        self.num_kv_layers = c.num_layers
        self.token_embd = weights["token_embd.weight"]
        self.output_norm = np.ascontiguousarray(dequantize(weights["output_norm.weight"]))
        self.output = self.token_embd if c.tie_word_embeddings else weights["output.weight"]
        self.nextn_layers, self.nextn_tensors = _nextn(weights, self.spec)  # an MTP drafter's (on the host)
        self.host = host
        self.ranges = ranges
        self.time_stages = time_stages
        if host is not None and not trim:  # first: the host's weight copies are what the devices upload from
            host.place(self)
        self.stages = [self._stage(s, r, be, host, recipes, compiled_decode, split)
                       for s, (r, be) in enumerate(zip(ranges, backends))]
        self.host_bytes = None  # bytes of the weights' RAM copies
        if host is not None and trim:  # the devices uploaded from the file; the host copies the rows it runs
            self.host_bytes = trim_copies(self.layers, np.logical_or.reduce([b.resident for b in backends]))
            host.place(self, keep=lambda name: False)
        if self.host_bytes is None:
            self.host_bytes = sum(t.raw.nbytes for t in weights.tensors.values() if t.raw.flags.writeable)
        self.links = [Link(a.backend, b.backend) for a, b in zip(self.stages, self.stages[1:])]
        self.backend = StagedBackends(self.stages)
        self.kv_pool = self.stages[0].kv_pool
        self.usage = None
        self.residency = None
        self.batch_groups, self.pipeline = batch_groups, None
        log.info("%d stages, %s; activations pass %s", len(self.stages), describe_split(ranges),
                 ", ".join(link.describe() for link in self.links))

    def _stage(self, index, layer_range, backend, host, recipes, compiled_decode, split):
        own = []
        for kv_index, i in enumerate(layer_range):
            own.append(replace(self.layers[i], kv_index=kv_index))
        layers = [own[i - layer_range.start] if i in layer_range else hollow(layer) for i, layer in
                  enumerate(self.layers)]
        first, last = layer_range.start == 0, layer_range.stop == self.config.num_layers
        view = StageWeights(self.config, layers, len(own), self.token_embd if first else None,
                            self.output if last else None, self.output_norm if last else None)
        backend.rt.use()  # its arrays are this device's
        try:
            backend.place(view, host)
        except VramError as exc:
            raise VramError(f"stage {index} ({backend.rt.device_name}, layers {layer_range.start}-"
                            f"{layer_range.stop - 1}): {exc}") from None
        stage = Stage(index, layer_range, backend, self.config, own)
        stage.kv_pool = backend.new_kv_pool(len(own), self.config.num_kv_heads, self.config.head_dim, self.kv_dtype,
                                            0)
        stage.split = None if host is None else ExpertSplit(host, split_resident(backend.resident, layer_range), split)
        stage.runner = choose_runner(tuple(recipes[i] for i in layer_range), backend, compiled_decode, stage.split)
        log.info("stage %d on %s: layers %d-%d, %d of %d experts resident; %s", index, backend.rt.device_name,
                 layer_range.start, layer_range.stop - 1, int(backend.resident.sum()),
                 int(sum(layer.gate_exps is not None for layer in own)) * self.config.num_experts,
                 backend.budget.describe())
        return stage

    def close(self):
        """Stop the stages' threads (their hybrid MoE workers, the pipeline's)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        for stage in self.stages:
            if stage.split is not None:
                stage.split.close()

    def new_sequence(self, max_tokens=None):
        max_tokens = max_tokens or self.config.context_length
        return StagedKV([s.backend.new_kv(s.kv_pool, max_tokens) for s in self.stages])

    def forward(self, batch):
        """Batch -> logits [len(batch.logit_rows), V]; each chunk's K/V is appended to its stages' caches. A batch of
        several chunks runs as pipelined slot groups (hybrid/pipeline.py) where batch_groups gives more than one."""
        with self.usage.step(batch) if self.usage is not None else contextlib.nullcontext():
            return self._forward_step(batch)

    def _forward_step(self, batch):
        for chunk in batch.chunks:
            chunk.kv.reserve(chunk.start + len(chunk.token_ids))
        count = num_groups(self.batch_groups, len(batch.chunks), len(self.stages))
        if count > 1:
            if self.pipeline is None:
                self.pipeline = Pipeline(self)
            logits = self.pipeline.run(batch, chunk_groups(batch, count))
        else:
            logits = self._in_sequence(batch)
        for chunk in batch.chunks:
            chunk.kv.commit(chunk.start + len(chunk.token_ids))
        return logits

    def _in_sequence(self, batch):
        """The stages one after another in this thread, activations passed by the links."""
        x = None
        for stage in self.stages:
            x = self._run_stage(stage, x, batch)
        logits = self.head(self.stages[-1].backend, x, batch)
        for stage in self.stages:
            if stage.split is not None:
                stage.split.finish_step(stage.backend, self.usage)
            self.add_busy(stage)
        return logits

    def head(self, be, x, batch):
        """Logits [len(batch.logit_rows), V] of the last stage's x [T, H] (on be, the last stage's backend); the
        chunks that ask for them get x's rows in batch.hidden (Model.forward's)."""
        if len(batch.hidden_rows):
            batch.hidden = be.to_host(be.take_rows(x, batch.hidden_rows))  # [T_hidden, H]
        if len(batch.logit_rows) == 0:
            return np.empty((0, self.config.vocab_size), dtype=np.float32)
        x = be.take_rows(x, batch.logit_rows)  # [T_out, H]
        return be.to_host(be.linear(self.output, be.rmsnorm(x, self.output_norm, self.config.rms_norm_eps)))

    def _run_stage(self, stage, x, batch):
        """x [T, H] of the previous stage (None: the first embeds) through this stage's layers."""
        be = stage.backend
        if stage.index == 0:
            x = be.embed(self.token_embd, batch.token_ids)  # [T, H]
        else:
            x = self.links[stage.index - 1].pass_on(x)
        start = self.event(be)
        stage.usage = self.usage
        if stage.split is not None:
            stage.split.begin_step()
        x = stage.runner.run(stage, x, stage.batch_of(batch))  # [T, H]
        if stage.split is not None:
            stage.split.wait_host()
        if start is not None:
            stage.events = [start, self.event(be)]
        return x

    def event(self, be):
        """A timing event recorded on be's stream (None when stages are not timed)."""
        if not self.time_stages:
            return None
        event = be.rt.event(timing=True)
        event.record(be.stream)
        return event

    @staticmethod
    def add_busy(stage):
        """Add the device time between the stage's recorded events to its busy_s (waits for the last)."""
        if stage.events:
            stage.busy_s += stage.backend.rt.elapsed(*stage.events)
            stage.events = []

    def device_stats(self):
        """[{stage, device, layers, busy_s, hit_rate_decode, hit_rate_prefill}] per stage (hit rates None without
        a usage record or before any routing)."""
        resident = self.backend.resident
        rates = hit_rates(self.usage, resident, self.ranges) if self.usage is not None else [{}] * len(self.stages)
        return [{"stage": s.index, "device": s.backend.rt.device_name, "layers": f"{s.layer_range.start}-"
                 f"{s.layer_range.stop - 1}", "busy_s": s.busy_s, "hit_rate_decode": r.get("decode"),
                 "hit_rate_prefill": r.get("prefill")} for s, r in zip(self.stages, rates)]



def build_staged(weights, cfg, gpus, options, host_options, split, resident=None, placement=None, profile=None,
                 max_context=4096):
    """A StagedModel over `gpus` (hybrid/devices.py) for the settings `cfg`: the split of --layer-split (or the
    placement's), each stage's resident experts from `resident` [L, E], the placement's GPU (a placement planned at
    start-up from `profile` for the devices' free memory), or its own default fill. options(resident) -> a stage GpuBackend's keywords; host_options: the CpuBackend's; split: SplitSettings.
    ValueError for what stages do not take."""
    from .backends.cpu import CpuBackend, _available_bytes
    from .backends.gpu import GpuBackend
    from .devices import open_runtimes, stage_free
    from .stages import layer_bytes, placement_or_none, planned_placement, stage_ranges, stage_resident

    if placement is not None and profile is not None:
        raise ValueError("give --placement or --profile, not both (a placement was already planned from a profile)")
    if cfg.expert_cache == "dynamic":
        raise ValueError("--expert-cache dynamic runs on one GPU; give --gpus with one GPU")
    c = weights.config
    runtimes = open_runtimes(gpus)
    placement = placement_or_none(placement)
    if profile is not None:
        placement = planned_placement(profile, weights, stage_free(runtimes), cfg, max_context, cfg.layer_split)
    ranges = stage_ranges(cfg.layer_split, c.num_layers, stage_free(runtimes), layer_bytes(weights), placement)
    backends = []
    for s, (rt, r) in enumerate(zip(runtimes, ranges)):
        rt.use()  # its stream is this device's
        backends.append(GpuBackend(rt, **options(stage_resident(r, c.num_layers, c.num_experts, resident, placement,
                                                                s))))
    trim = cfg.trim_stage_weights
    if trim is None:  # on when the model takes over half of the available RAM
        trim = sum(t.raw.nbytes for t in weights.tensors.values()) > _available_bytes() / 2
    return StagedModel(weights, backends, ranges, CpuBackend(**host_options), kv_dtype=cfg.kv,
                       compiled_decode=cfg.compiled_decode, split=split, trim=trim, batch_groups=cfg.batch_groups)
