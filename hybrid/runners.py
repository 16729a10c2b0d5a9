"""Layer runners: how a step's layers run, each made from the family's layer recipe.

`choose_runner` picks one at the model's construction from the backend's declared capabilities:
- PlainRunner: the recipe's steps (hybrid/blocks.py) one by one, every op a backend call. It runs every
  batch; the others hand it the batches they do not take.
- GraphRunner (a backend with layer graphs: the GPU): one sequence's one-token decode step, each layer's
  runs of consecutive capturable steps captured once as a graph region and replayed after.
- the backend's own (a backend with compiled layers: the CPU's hybrid/backends/cpu_layer.py), made
  by `backend.layer_runner(recipe, plain)`, which gives `plain` back for a recipe it cannot compile.
A runner's `last_path` names the path its latest step took ("plain", "graphs", "compiled", "fused").
Shape legend: T tokens, H hidden.
"""
from .blocks import layer_steps


class PlainRunner:
    """Every layer op by op."""

    def __init__(self, recipe):
        self.steps = layer_steps(recipe)
        if self.steps is None:
            raise ValueError(f"no implementation of every part of {recipe}")
        self.last_path = None

    def run(self, model, x, batch):
        """x [T, H] through every layer (in place); returns x."""
        be = model.backend
        for layer in model.layers:
            s = {"x": x, "batch": batch, "split": model.split, "usage": model.usage}
            for step in self.steps:
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
        self.program = graph_regions(plain.steps)
        self.last_path = None

    def regions(self):
        """Each region's step names, in order."""
        return [tuple(step.name for step in steps) for region, steps in self.program if region is not None]

    def run(self, model, x, batch):
        if not (self.graphs.enabled and len(batch.chunks) == 1 and len(batch.token_ids) == 1):
            self.last_path = "plain"
            return self.plain.run(model, x, batch)
        be = model.backend
        x = self.graphs.begin_step(be, x, batch.positions)  # [1, H], the fixed buffer the graphs read
        for layer in model.layers:
            s = {"x": x, "batch": batch, "split": model.split, "usage": model.usage}
            for region, steps in self.program:
                if region is None:
                    steps[0].run(be, layer, s)
                else:
                    s.update(self.graphs.run(be, (region, layer.index),
                                             lambda steps=steps: _run_region(be, layer, steps, s)))
        self.last_path = "graphs"
        return x


def choose_runner(recipe, backend, compiled_decode, split):
    """The runner of a model: graphs or compiled layers where the backend declares them (compiled layers only
    with compiled_decode and no expert split), else op by op."""
    plain = PlainRunner(recipe)
    capabilities = backend.capabilities
    if capabilities.graphed_decode and backend.layer_graphs is not None:
        return GraphRunner(backend.layer_graphs, plain)
    if capabilities.compiled_decode_layer and compiled_decode and split is None:
        return backend.layer_runner(recipe, plain)
    return plain
