"""Layer runners: how a step's layers run, each made from the family's layer recipe.

`choose_runner` picks one at the model's construction from the backend's declared capabilities and the
layers' recipes (one per layer: a family's layers may differ):
- PlainRunner: the recipe's steps (hybrid/blocks.py) one by one, every op a backend call. It runs every
  batch; the others hand it the batches they do not take.
- GraphRunner (a backend with layer graphs: the GPU): a decode step of one-token chunks (one sequence's, or several
  users') as one graph where nothing in it needs the host (hybrid/step_graph.py), else one sequence's each layer's
  runs of consecutive capturable steps captured once as a graph region and replayed after.
- the backend's own (a backend with compiled layers: the CPU's hybrid/backends/cpu_layer.py), made
  by `backend.layer_runner(recipe, plain)`, which gives `plain` back for a recipe it cannot compile.
A runner's `last_path` names the path its latest step took ("plain", "graphs", "compiled", "fused").
Shape legend: T tokens, H hidden.
"""
from .arch.recipe import LayerRecipe
from .blocks import layer_steps
from .step_graph import (queue_step, record_step_routing, relay_key, run_step, step_graph_plan, step_graph_ready,
                         step_tokens_fit)


class PlainRunner:
    """Every layer op by op. recipes: one LayerRecipe per layer, or one for every layer. steps: the first layer's
    steps; steps_of(i): layer i's."""

    def __init__(self, recipes):
        self.recipes = recipes
        made = {}
        for recipe in (recipes,) if isinstance(recipes, LayerRecipe) else recipes:
            if recipe not in made:
                made[recipe] = layer_steps(recipe)
                if made[recipe] is None:
                    raise ValueError(f"no implementation of every part of {recipe}")
        self._steps = made
        self.steps = next(iter(made.values()))
        self.last_path = None

    def steps_of(self, index):
        return self.steps if isinstance(self.recipes, LayerRecipe) else self._steps[self.recipes[index]]

    def run(self, model, x, batch):
        """x [T, H] through every layer (in place); returns x."""
        be = model.backend
        for i, layer in enumerate(model.layers):
            s = {"x": x, "batch": batch, "split": model.split, "usage": model.usage}
            for step in self.steps_of(i):
                step.run(be, layer, s)
        self.last_path = "plain"
        return x


def graph_regions(steps):
    """((region number or None, steps), ...): runs of consecutive capturable steps as numbered regions, each
    other step alone (None)."""
    program, run = [], []
    for step in steps:
        if step.capturable:
            run.append(step)
            continue
        if run:
            program.append((sum(r is not None for r, _ in program), tuple(run)))
            run = []
        program.append((None, (step,)))
    if run:
        program.append((sum(r is not None for r, _ in program), tuple(run)))
    return tuple(program)


def _run_region(be, layer, steps, s):
    """Run steps; return the state entries they set (a region's outputs, kept with its graph)."""
    before = dict(s)
    for step in steps:
        step.run(be, layer, s)
    return {key: value for key, value in s.items() if before.get(key) is not value}


class GraphRunner:
    """One token of one sequence through layer graph regions (graphs: a LayerGraphs,
    hybrid/backends/gpu_layer_graphs.py); other batches, or all once capture failed, through `plain`."""

    def __init__(self, graphs, plain):
        self.graphs, self.plain = graphs, plain
        self.program = graph_regions(plain.steps)  # the first layer's
        self._programs = {id(steps): graph_regions(steps) for steps in plain._steps.values()}
        self._step_ready = None  # whether a whole step may be one graph (known at the first step)
        self.last_path = None

    def _step_graph_ready(self, model, be):
        if self._step_ready is None:
            self._step_ready = be.capabilities.step_graph and step_graph_ready(self.plain.steps_of, len(model.layers))
        return self._step_ready

    def regions(self):
        """Each region's step names, in order (the first layer's)."""
        return [tuple(step.name for step in steps) for region, steps in self.program if region is not None]

    def run(self, model, x, batch):
        be = model.backend
        one = len(batch.chunks) == 1 and len(batch.token_ids) == 1
        if not (self.graphs.enabled and (one or step_tokens_fit(model, batch))):
            self.last_path = "plain"
            return self.plain.run(model, x, batch)
        plan = step_graph_plan(model, batch) if self._step_graph_ready(model, be) else None
        if plan is None and not one:  # several users' tokens: a step graph or op by op
            self.last_path = "plain"
            return self.plain.run(model, x, batch)
        x = self.graphs.begin_step(be, x, batch.positions)  # [n, H], the fixed buffer the graphs read
        if plan is not None:
            bound, relayed = plan
            key = (*be.step_graph_key(batch.chunks, bound), model.usage is not None,  # usage: keeps routing
                   relay_key(model, relayed))
            outputs = run_step(model, self.graphs, key, batch, relayed, lambda: queue_step(
                model, x, batch, self.plain.steps_of, self.graphs.position, bound))
            record_step_routing(model, outputs)
            self.last_path = "step graph"
            return x
        for i, layer in enumerate(model.layers):
            s = {"x": x, "batch": batch, "split": model.split, "usage": model.usage}
            for region, steps in self._programs[id(self.plain.steps_of(i))]:
                if region is None:
                    steps[0].run(be, layer, s)
                else:
                    s.update(self.graphs.run(be, (region, layer.index),
                                             lambda steps=steps: _run_region(be, layer, steps, s)))
        self.last_path = "graphs"
        return x


def choose_runner(recipes, backend, compiled_decode, split):
    """The runner of a model (recipes: one per layer, or one for all): graphs or compiled layers where the backend
    declares them (compiled layers only with compiled_decode and no expert split; the backend's runner takes the
    recipes as given), else op by op."""
    plain = PlainRunner(recipes)
    capabilities = backend.capabilities
    if capabilities.graphed_decode and backend.layer_graphs is not None:
        return GraphRunner(backend.layer_graphs, plain)
    if capabilities.compiled_decode_layer and compiled_decode and split is None:
        return backend.layer_runner(recipes, plain)
    return plain
