"""What `strata setup` chooses from the measured Machine (measure.py) and the model: device, threads,
parallel, max_context, kv, kv_resident, the layer split and the placement (the planner, placement/), each a
Choice with the reason written beside it in the config; and the predictions (decode tok/s per slot, VRAM and
RAM use). Values the user fixed (`fixed`: their own keys in the config file) are taken as given."""
from dataclasses import dataclass, field

import numpy as np

from placement.budget import MIB, BudgetError, ModelSizes
from placement.planner import Budgets, CostModel, Speeds, plan
from placement.profile import ExpertProfile

from ..config import SETTINGS

PREDICT_CONTEXT = 2048  # the context (tokens a slot holds) the printed predictions are for, unless told
CONTEXT_STEP = 1024  # max_context is lowered in steps of this many tokens
RAM_KV_SHARE = 0.25  # of the RAM left after the model: for KV on the CPU (the conversation cache takes its own)
VRAM_KV_SHARE = 1 / 3  # of a GPU's room after dense weights and scratch: for KV, the rest for experts
MIN_WINDOW = 4096  # the smallest --kv-resident window setup writes
# Host and launch time of a GPU decode layer beyond the bytes it reads, which the planner's cost model leaves out:
# 178.6 tok/s over 52 layers of an 8.5 GB model, every expert resident, H100 (bench/results/gpu_model.md).
GPU_LAYER_S = 100e-6
# The same on the CPU (attention, norms, router, the step's Python): ~0.5 ms a layer on the 2-core VM both for the
# 14 MB demo (394 tok/s, 4 layers) and the 16-layer Q4_K_M model of bench/results/cpu_decode.md (20.7 tok/s).
CPU_LAYER_S = 500e-6


@dataclass(frozen=True)
class Choice:
    name: str
    value: object
    why: str


@dataclass
class Plan:
    """Setup's choices and predictions. A decode step's time is a part that does not depend on the context and
    a part that grows with it (attention over every token a slot holds): predictions are for a stated context."""

    choices: list = field(default_factory=list)
    parallel: int = 1  # the slots the predictions are for
    context: int = PREDICT_CONTEXT  # tokens each slot holds in the predictions
    step_s: float = 0.0  # one slot decoding alone, without its attention's growth with the context
    busy_step_s: float = 0.0  # the same, every slot decoding
    key_s: float = 0.0  # one slot's added step time per token of its context
    vram_mib: tuple = ()  # per GPU
    ram_mib: float = 0.0
    placement: object = None  # a Placement to save beside the config, or None

    def value(self, name):
        return next((c.value for c in self.choices if c.name == name), None)

    def alone_at(self, context):
        """Predicted decode tok/s of one slot decoding alone, holding `context` tokens."""
        return 1 / (self.step_s + self.key_s * context) if self.step_s else 0.0

    def busy_at(self, context):
        """Predicted decode tok/s of each slot with every slot decoding, each holding `context` tokens."""
        return 1 / (self.busy_step_s + self.parallel * self.key_s * context) if self.busy_step_s else 0.0

    @property
    def alone_tok_s(self):
        return self.alone_at(self.context)

    @property
    def decode_tok_s(self):
        return self.busy_at(self.context)


class Chooser:
    """The choices of one model on one machine; `fixed` {name: value} are the user's and are not chosen."""

    def __init__(self, machine, sizes, context_length, fixed=None, profile=None, model_bytes=None,
                 predict_context=PREDICT_CONTEXT):
        self.m, self.sizes, self.context_length = machine, sizes, context_length
        self.fixed, self.profile = dict(fixed or {}), profile
        self.model_bytes = model_bytes if model_bytes is not None else _model_bytes(sizes)
        self.predict_context = predict_context
        self.plan = Plan()

    def pick(self, name, value, why):
        """`value` for setting `name` unless the user fixed it; returns the value in force."""
        if name in self.fixed:
            return self.fixed[name]
        self.plan.choices.append(Choice(name, value, why))
        return value

    def given(self, name):
        return self.fixed.get(name, SETTINGS[name].default)

    def choose(self):
        m = self.m
        self.plan.context = self.predict_context
        why = (f"{len(m.gpus)} GPU(s) measured: " + ", ".join(f"{g.name} {g.vram_mib:.0f} MiB" for g in m.gpus)
               if m.gpus else f"no GPU ({m.gpu_note})")
        what, rates = (("the CPU decode kernels over this model's experts", m.expert_gbps) if m.expert_gbps else
                       ("DRAM read (the expert kernels were not timed)", m.dram_gbps))
        self.pick("cpu_gbps", m.cpu_gbps, f"the best measured rate of {what} (threads: GB/s " + ", ".join(
            f"{n}: {gbps:g}" for n, gbps in sorted(rates.items())) + "): what CPU experts stream at")
        if self.fixed.get("device", "gpu") != "cpu" and m.gpus:
            try:
                self.pick("device", "gpu", why)
                self._choose_gpu()
                return self.plan
            except BudgetError as exc:
                if self.fixed.get("device") == "gpu":
                    raise ValueError(f"setup: the model does not fit these GPUs: {exc}") from None
                self.plan = Plan(choices=[c for c in self.plan.choices if c.name == "cpu_gbps"])
                self.plan.context = self.predict_context
                why = f"the GPUs cannot hold the model's dense part: {exc}"
        self.pick("device", "cpu", why)
        self._choose_cpu()
        return self.plan

    def _kv_bytes(self, kv, tokens, slots):
        return slots * tokens * self.sizes.num_layers * self.sizes.kv_bytes_per_token(kv)

    def _choose_cpu(self):
        parallel = self.pick("parallel", 1, "CPU only: every slot shares the DRAM bandwidth, one slot decodes "
                                            "fastest (set parallel yourself for several users; setup keeps it)")
        room = max(self.m.free_ram_mib * MIB - self.model_bytes, 0) * RAM_KV_SHARE
        self.plan.parallel = parallel
        kv, context, why = self._fit_kv(("f32", "f16", "int8"), parallel, room, "RAM")
        kv = self.pick("kv", kv, why)
        context = self.pick("max_context", context, why)
        overhead, rate = self.sizes.num_layers * CPU_LAYER_S, self.m.cpu_gbps * 1e9
        self.plan.busy_step_s = self._step_bytes(parallel) / rate + overhead
        self.plan.step_s = self._step_bytes(1) / rate + overhead
        self.plan.key_s = self._kv_bytes(kv, 1, 1) / rate  # attention on the CPU streams the KV
        self.plan.ram_mib = (self.model_bytes + self._kv_bytes(kv, context, parallel)) / MIB

    def _fit_kv(self, kvs, parallel, room, where):
        """(kv, max_context, why): the most exact kv whose KV of `parallel` slots at the model's context fits
        `room` bytes, else the last of kvs at the longest context that fits."""
        limit = self.fixed.get("max_context", self.context_length)
        kvs = (self.fixed["kv"],) if "kv" in self.fixed else kvs
        for kv in kvs:
            need = self._kv_bytes(kv, limit, parallel)
            if need <= room:
                return kv, limit, (f"KV of {parallel} slot(s) x {limit} tokens in {kv}: {need / MIB:.0f} MiB of the "
                                   f"{room / MIB:.0f} MiB {where} budget")
        kv = kvs[-1]
        per_slot_token = self._kv_bytes(kv, 1, parallel)
        context = max(CONTEXT_STEP, int(room // per_slot_token) // CONTEXT_STEP * CONTEXT_STEP)
        return kv, min(context, limit), (f"the model's {limit} tokens x {parallel} slot(s) do not fit the "
                                         f"{room / MIB:.0f} MiB {where} budget even in {kv}: context lowered")

    def _step_bytes(self, parallel):
        """Bytes a decode step of `parallel` slots reads besides their KV: dense and head once, the distinct
        experts of its tokens (expected, every expert equally likely), each slot's recurrent state."""
        s = self.sizes
        distinct = s.num_experts * (1 - (1 - s.num_experts_per_tok / s.num_experts) ** parallel)
        return (sum(s.layer_dense_bytes) + s.head_bytes + distinct * sum(s.expert_bytes)
                + parallel * s.state_bytes(range(s.num_layers)))

    def _choose_gpu(self):
        m = self.m
        parallel = self.pick("parallel", 4 if len(m.gpus) > 1 or m.gpus[0].vram_mib >= 40000 else 2,
                             "a GPU batches slots nearly for free: the experts a step reads are shared")
        self.plan.parallel = parallel
        reserve = self.given("vram_reserve_mib")
        room = sum(g.free_mib for g in m.gpus) * MIB - self.model_bytes_dense() - reserve * len(m.gpus) * MIB
        kv, context, why = self._fit_kv(("f16", "int8"), parallel, max(room, 0) * VRAM_KV_SHARE, "VRAM KV")
        kv = self.pick("kv", kv, why + " (f16 KV is ~1e-3 off f32)")
        limit = self.fixed.get("max_context", self.context_length)
        window = self.fixed.get("kv_resident")
        if context < limit and window is None:  # the whole context does not fit in VRAM: older tokens to RAM
            window = max(MIN_WINDOW, context // CONTEXT_STEP * CONTEXT_STEP)
            pinned = self._kv_bytes(kv, limit - window, parallel) / MIB
            self.pick("kv_resident", window, f"{parallel} slot(s) x {limit} tokens of {kv} KV exceed the VRAM KV "
                      f"budget; the newest {window} tokens stay in VRAM, the rest ({pinned:.0f} MiB) in pinned RAM"
                      + self._pinned_note(pinned))
        context = limit if window is not None else context
        context = self.pick("max_context", context, f"the model's context ({self.context_length} tokens)")
        self._place(parallel, context, kv, window, reserve)

    def _gpu_key_seconds(self, kv, gpu_gbps):
        """A slot's step time per token of context on the GPU: the measured one-token attention's per-key time
        over every layer with KV, else (not measured) the KV's bytes at the on-device bandwidth."""
        layers = self.sizes.kv_layers(range(self.sizes.num_layers))
        cost = self.m.attention.get(kv)
        if cost is not None:
            return layers * cost.per_key_s
        return self._kv_bytes(kv, 1, 1) / (gpu_gbps * 1e9)

    def _pinned_note(self, mib):
        limit = self.m.pinned_limit_mib
        if limit is not None and mib > limit:
            return f" (above the {limit:.0f} MiB locked-memory limit, ulimit -l: raise it if pinning fails)"
        return f" (of {self.m.free_ram_mib:.0f} MiB free RAM)"

    def model_bytes_dense(self):
        s = self.sizes
        return sum(s.layer_dense_bytes) + s.embed_bytes + s.head_bytes

    def _place(self, parallel, context, kv, window, reserve):
        m, s = self.m, self.sizes
        profile = self.profile or uniform_profile(s)
        split = self.given("layer_split")
        budgets = Budgets(tuple(g.free_mib for g in m.gpus), parallel, context, kv, reserve, split, window)
        speeds = Speeds(m.cpu_gbps, min(g.vram_gbps for g in m.gpus) or Speeds().gpu_gbps)
        placement = plan(profile, s, budgets, speeds)
        if len(m.gpus) > 1:
            firsts = ",".join(str(g.first_layer) for g in placement.gpus[1:])
            self.pick("layer_split", firsts, "the planner's fastest split of the layers over the GPUs (written out "
                                             "so that a re-run keeps the layout unless you change it)")
        if self.profile is not None:
            self.plan.placement = placement
        self.pick("gpu_gbps", speeds.gpu_gbps, "the slowest GPU's measured on-device copy bandwidth")
        overhead = s.num_layers * GPU_LAYER_S
        probs, _ = profile.decode_estimate()
        mask = placement.resident_mask(s.num_layers, s.num_experts)
        # without KV (max_context 0): the attention's growth with the context is the measured key_s
        self.plan.busy_step_s = CostModel(probs, s, parallel, speeds, 0, kv).step_seconds(mask) + overhead
        self.plan.step_s = CostModel(probs, s, 1, speeds, 0, kv).step_seconds(mask) + overhead
        self.plan.key_s = self._gpu_key_seconds(kv, speeds.gpu_gbps)
        self.plan.vram_mib = tuple(_used_mib(g.budget) for g in placement.gpus)
        pinned = 0 if window is None else self._kv_bytes(kv, max(context - window, 0), parallel)
        self.plan.ram_mib = (self.model_bytes + pinned) / MIB


def _used_mib(budget):
    """VRAM a GPU's plan uses: dense, KV, scratch, reserve and its expert slots."""
    return sum(budget[k] for k in ("dense_mib", "kv_mib", "scratch_mib", "reserve_mib")) + (
        budget["expert_slots"] * budget["slot_mib"])


def uniform_profile(sizes):
    """A profile where every expert is equally likely: the planner's predictions without a measured one."""
    profile = ExpertProfile.empty("uniform", sizes.num_layers, sizes.num_experts, sizes.num_experts_per_tok)
    profile.decode[:] = 1
    profile.tokens_decode = max(1, sizes.num_experts // sizes.num_experts_per_tok)
    return profile


def _model_bytes(sizes):
    return (sum(sizes.layer_dense_bytes) + sizes.num_experts * sum(sizes.expert_bytes) + sizes.embed_bytes
            + sizes.head_bytes)


def choose(machine, weights, fixed=None, profile=None, predict_context=PREDICT_CONTEXT):
    """The Plan for `weights` (hybrid.formats) on `machine`, keeping the user's `fixed` values; its predictions
    are for slots holding `predict_context` tokens."""
    sizes = ModelSizes.from_weights(weights)
    model_bytes = int(sum(np.int64(t.raw.nbytes) for t in weights.tensors.values()))
    return Chooser(machine, sizes, weights.config.context_length, fixed, profile, model_bytes,
                   predict_context).choose()
