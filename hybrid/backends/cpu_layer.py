"""The CPU backend's layer runner: a decode step's layers as one compiled call each (cpu_decode.py), or
from FUSED_MIN_THREADS threads as one parallel region each (cpu_decode_fused.py); every other batch
through the plain runner it is given.

Between two layers the interpreter runs with its data evicted by the layer before, ~4x slower than warm,
so the choices that hold for the whole step (thread count, fused or not, the fused layers' work arrays)
are made once before the first layer and each layer's own Python is a lookup and the call.

Shape legend: T tokens (one a sequence), H hidden, K top-k.
"""
import numba

from .cpu_decode import COMPILED_PARTS, DecodeStep, LayerPlan
from .cpu_decode_fused import fused_layer, fuses, new_work

FUSED_MIN_THREADS = 2  # from this many threads a compiled decode layer runs as one parallel region
FUSED_WORK_KEPT = 4  # batch sizes whose fused-layer work arrays stay allocated


def compiled_runner(backend, recipe, plain):
    """A CompiledRunner for `recipe`, or `plain` where the compiled layer has no implementation of one of its
    parts."""
    compiled = all(type(part) in COMPILED_PARTS and COMPILED_PARTS[type(part)].takes(part) for part in recipe.parts())
    if not compiled:
        return plain
    return CompiledRunner(backend, recipe, plain, fused_parts=fuses(recipe))


class CompiledRunner:
    """plans: layer index -> LayerPlan, made at the layer's first decode step. last_path: "compiled", "fused" or
    "plain" (the latest step's). backend.fused_decode: True / False forces the fused layers on / off; None: on
    from FUSED_MIN_THREADS threads (and where the recipe's parts have fused implementations)."""

    def __init__(self, backend, recipe, plain, fused_parts):
        self.backend, self.recipe, self.plain, self.fused_parts = backend, recipe, plain, fused_parts
        self.plans = {}
        self.last_path = None

    @staticmethod
    def takes(batch):
        """A batch of one-token chunks whose sequences share one float32 KV pool."""
        pool = batch.chunks[0].kv.pool
        return (pool.dtype == "f32" and all(c.kv.pool is pool for c in batch.chunks)
                and all(len(c.token_ids) == 1 for c in batch.chunks))

    def run(self, model, x, batch):
        """x [T, H] through every layer, in place; returns x."""
        if not self.takes(batch):
            self.last_path = "plain"
            return self.plain.run(model, x, batch)
        be, usage = self.backend, model.usage
        step = DecodeStep(batch)
        threads = numba.get_num_threads()
        forced = be.fused_decode
        fused = self.fused_parts and (threads >= FUSED_MIN_THREADS if forced is None else forced)
        works = {}  # LayerPlan.shapes: the fused layers' work arrays for this step's batch and threads
        for layer in model.layers:
            plan = self.plans.get(layer.index)
            if plan is None or not plan.current(layer):
                plan = self.plans[layer.index] = LayerPlan(be, layer, self.recipe)  # (its weights' kernels set act_quant)
            if fused:
                work = works.get(plan.shapes)
                if work is None:
                    work = works[plan.shapes] = self._fused_work(plan, x.shape[0], threads)
                if plan.fused_call is None:
                    plan.fused_call = fused_layer(be, layer, self.recipe)
                fn, args = plan.fused_call
                ids = fn(x, step.positions, step.tables, step.pool.k, step.pool.v, layer.index, be.act_quant,
                         be.stage_trace, work, *args)
            else:
                ids = plan.fn(x, step.positions, step.tables, step.pool.k, step.pool.v, layer.index, threads == 1,
                              be.act_quant, *plan.args)
            if usage is not None:
                usage.record(layer.index, ids)
        self.last_path = "fused" if fused else "compiled"
        return x

    def _fused_work(self, plan, num_tokens, threads):
        """The fused layer's work arrays for the plan's layer shapes, this batch size and thread count (kept
        per thread; the FUSED_WORK_KEPT most recently used sets)."""
        key = (plan.shapes, num_tokens, threads)
        kept = self.backend._scratch().fused_work
        work = kept.pop(key, None)
        if work is None:
            work = new_work(plan.layer, self.recipe, num_tokens, threads)
            while len(kept) >= FUSED_WORK_KEPT:
                kept.pop(next(iter(kept)))
        kept[key] = work
        return work
