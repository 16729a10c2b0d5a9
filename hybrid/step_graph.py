"""A whole one-token decode step as one device graph (GraphRunner's fast path; the GPU's is
hybrid/backends/gpu_step.py).

Taken when nothing in the step needs the host: the backend declares `step_graph`, every step of every
layer is capturable or may run inside a step graph (hybrid/blocks.py Step.step_graph), every expert is
resident (no host part, no relay), the split is not traced, and the backend accepts the sequence's KV.
The routing the usage record needs is copied inside the graph and read back once a step.
"""


def step_graph_ready(steps_of, num_layers):
    """Whether every step of every layer may run inside a step graph."""
    return all(step.capturable or step.step_graph for i in range(num_layers) for step in steps_of(i))


def step_graph_bound(model, batch):
    """The keys bound of a step graph for this one-token batch, or None where the step needs the host."""
    be, split = model.backend, model.split
    if split is not None and (split.trace is not None or not split.resident.all()):
        return None
    chunk = batch.chunks[0]
    return be.prepare_step_graph(chunk.kv, chunk.start, len(model.layers), model.config.num_experts_per_tok)


def queue_step(model, x, batch, steps_of, position, bound):
    """Every layer's steps over x [1, H] with the position read on the device; returns the graph's outputs: the
    (routing row, layer index) of the layers whose routing the graph keeps (with a usage record), and a KV with a
    recurrent state (its graph is its own: held so that its id stays its own)."""
    be, keep_routing, routed = model.backend, model.usage is not None, []
    be.begin_step_graph(position, bound)
    try:
        for i, layer in enumerate(model.layers):
            s = {"x": x, "batch": batch, "split": model.split, "usage": None}
            for step in steps_of(i):
                step.run(be, layer, s)
            if keep_routing and "ids" in s:
                be.keep_step_routing(i, s["ids"])  # the model's i-th layer (a pipeline stage's may not be layer i)
                routed.append((i, layer.index))
    finally:
        be.end_step_graph()
    kv = batch.chunks[0].kv
    return {"routed_layers": tuple(routed), **({"kv": kv} if kv.recurrent is not None else {})}


def record_step_routing(model, outputs):
    """After a step graph's launch: queue the read-back of its routing for the split's usage record."""
    if model.usage is not None and model.split is not None and outputs["routed_layers"]:
        model.split.defer_step_routing(model.backend.queue_step_routing(), outputs["routed_layers"])
