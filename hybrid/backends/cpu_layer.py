"""The CPU backend's layer runner: a decode step's layers as one compiled call each (cpu_decode.py), or
from FUSED_MIN_THREADS threads as one parallel region each (cpu_decode_fused.py); every other batch
through the plain runner it is given.

Between two layers the interpreter runs with its data evicted by the layer before, ~4x slower than warm,
so the choices that hold for the whole step (thread count, fused or not, the fused layers' work arrays)
are made once before the first layer and each layer's own Python is a lookup and the call.

Shape legend: T tokens (one a sequence), H hidden, K top-k.
"""
import numba
import numpy as np

from ..arch.recipe import LayerRecipe, MoE
from ..blocks import block_steps
from . import cpu_decode_ffn, cpu_decode_fused_ffn
from .cpu_decode import DecodeStep, LayerPlan, compiles
from .cpu_decode_fused import fused_layer, fuses, new_work

FUSED_MIN_THREADS = 2  # from this many threads a compiled decode layer runs as one parallel region
FUSED_WORK_KEPT = 8  # (layer kind, batch size) pairs whose fused-layer work arrays stay allocated

cpu_decode_ffn.register()
cpu_decode_fused_ffn.register()


def compiled_runner(backend, recipes, plain):
    """A CompiledRunner for `recipes` (one LayerRecipe per layer, or one for every layer), or `plain` where no block
    of any layer has a compiled implementation."""
    distinct = {recipes} if isinstance(recipes, LayerRecipe) else set(recipes)
    kinds = {recipe: LayerKind(recipe) for recipe in distinct}
    if not any(any(kind.compiled) for kind in kinds.values()):
        return plain
    return CompiledRunner(backend, recipes, kinds, plain)


class LayerKind:
    """What the runner does with a recipe's layers: `compiled` (per block: whether it compiles, else its plain
    steps `steps` run it), `fuses` (the whole layer as one parallel region: cpu_decode_fused.py)."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.compiled = tuple(compiles(block) for block in recipe.blocks)
        self.steps = tuple(None if on else block_steps(block) for block, on in zip(recipe.blocks, self.compiled))
        self.fuses = all(self.compiled) and fuses(recipe)


class CompiledRunner:
    """plans: layer index -> LayerPlan, made at the layer's first decode step. last_path: "compiled", "fused" or
    "plain" (the latest step's; "compiled" also where some blocks ran op by op). backend.fused_decode: True / False
    forces the fused layers on / off; None: on from FUSED_MIN_THREADS threads (for layers whose parts have fused
    implementations; the others run compiled)."""

    def __init__(self, backend, recipes, kinds, plain):
        self.backend, self.recipes, self.kinds, self.plain = backend, recipes, kinds, plain
        self.fused_parts = any(kind.fuses for kind in kinds.values())
        self.plans = {}
        self.last_path = None

    def kind_of(self, index):
        return self.kinds[self.recipes if isinstance(self.recipes, LayerRecipe) else self.recipes[index]]

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
        one_thread = threads == 1
        forced = be.fused_decode
        fused_on = self.fused_parts and (threads >= FUSED_MIN_THREADS if forced is None else forced)
        works = {}  # LayerPlan.shapes: the fused layers' work arrays for this step's batch and threads
        any_fused = False
        for i, layer in enumerate(model.layers):
            kind = self.kind_of(i)
            plan = self.plans.get(layer.index)
            if plan is None or not plan.current(layer):  # (its weights' kernels set act_quant)
                plan = self.plans[layer.index] = LayerPlan(be, layer, kind.recipe, kind.compiled)
            kv_layer = 0 if layer.kv_index is None else layer.kv_index
            if fused_on and kind.fuses:
                ids = self._fused(plan, layer, kind.recipe, x, step, kv_layer, works, threads)
                any_fused = True
            elif plan.fn is not None:
                ids = plan.fn(x, step.positions, step.tables, step.pool.k, step.pool.v, kv_layer, one_thread,
                              be.act_quant, *plan.args)
            else:
                ids = self._blocks(model, plan, kind, layer, x, batch, step, kv_layer, one_thread)
            if usage is not None and ids is not None and ids.shape[1]:
                usage.record(layer.index, ids)
        self.last_path = "fused" if any_fused else "compiled"
        return x

    def _fused(self, plan, layer, recipe, x, step, kv_layer, works, threads):
        be = self.backend
        if plan.shapes is None:
            ffn = recipe.ffn.part  # (layers whose work arrays match share them: gpt-oss's sliding and full ones)
            plan.shapes = (type(recipe.mixer.part), type(ffn), isinstance(ffn, MoE) and ffn.shared is not None,
                           layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.num_experts_per_tok,
                           tuple(w.shape for w in plan.weights))
        work = works.get(plan.shapes)
        if work is None:
            work = works[plan.shapes] = self._fused_work(plan, recipe, x.shape[0], threads)
        if plan.fused_call is None:
            plan.fused_call = fused_layer(be, layer, recipe)
        fn, args = plan.fused_call
        return fn(x, step.positions, step.tables, step.pool.k, step.pool.v, kv_layer, be.act_quant, be.stage_trace,
                  work, *args)

    def _blocks(self, model, plan, kind, layer, x, batch, step, kv_layer, one_thread):
        """A layer block by block: compiled blocks as one call each, the others through their plain steps. Returns
        the routing ids of a compiled MoE block (a plain one records its own), else None."""
        be, ids = self.backend, None
        for compiled, steps in zip(plan.blocks, kind.steps):
            if compiled is None:
                s = {"x": x, "batch": batch, "split": model.split, "usage": model.usage}
                for one in steps:
                    one.run(be, layer, s)
            else:
                fn, args = compiled
                ids = fn(x, np.empty_like(x), step.positions, step.tables, step.pool.k, step.pool.v, kv_layer,
                         one_thread, be.act_quant, args)
        return ids

    def _fused_work(self, plan, recipe, num_tokens, threads):
        """The fused layer's work arrays for the plan's layer shapes, this batch size and thread count (kept
        per thread; the FUSED_WORK_KEPT most recently used sets)."""
        key = (plan.shapes, num_tokens, threads)
        kept = self.backend._scratch().fused_work
        work = kept.pop(key, None)
        if work is None:
            work = new_work(plan.layer, recipe, num_tokens, threads)
            while len(kept) >= FUSED_WORK_KEPT:
                kept.pop(next(iter(kept)))
        kept[key] = work
        return work
