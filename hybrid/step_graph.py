"""A whole decode step of one-token chunks as one device graph (GraphRunner's fast path; the GPU's is
hybrid/backends/gpu_step.py): one sequence's next token, or up to MAX_STEP_TOKENS users' at once.

Taken when nothing in the step needs the host: the backend declares `step_graph`, every step of every
layer is capturable or may run inside a step graph (hybrid/blocks.py Step.step_graph), every expert is
resident (no host part, no relay), the split is not traced, and the backend accepts the sequences' KV.
The routing the usage record needs is copied inside the graph and read back once a step.
Shape legend: n chunks of one token each, H hidden, K top-k.
"""

MAX_STEP_TOKENS = 16  # the most one-token chunks (users decoding at once) a step graph takes


def step_graph_ready(steps_of, num_layers):
    """Whether every step of every layer may run inside a step graph."""
    return all(step.capturable or step.step_graph for i in range(num_layers) for step in steps_of(i))


def step_tokens_fit(model, batch):
    """Whether a batch's shape may take a step graph: one-token chunks, at most MAX_STEP_TOKENS of them, and no
    more (token, expert) pairs than the backend's decode step takes."""
    n, k = len(batch.chunks), model.config.num_experts_per_tok
    limit = model.backend.capabilities.max_decode_pairs or n * k
    return len(batch.token_ids) == n and n <= MAX_STEP_TOKENS and n * k <= limit


def step_graph_bound(model, batch):
    """The keys bound of a step graph for this batch of one-token chunks, or None where the step needs the host."""
    be, split = model.backend, model.split
    if split is not None and (split.trace is not None or not split.resident.all()):
        return None
    if not step_tokens_fit(model, batch):
        return None
    return be.prepare_step_graph(batch.chunks, len(model.layers), model.config.num_experts_per_tok)


def queue_step(model, x, batch, steps_of, positions, bound):
    """Every layer's steps over x [n, H] with the positions read on the device; returns the graph's outputs: the
    (routing row, layer index) of the layers whose routing the graph keeps (with a usage record), the token count,
    and a KV with a recurrent state (its graph is its own: held so that its id stays its own)."""
    be, keep_routing, routed = model.backend, model.usage is not None, []
    be.begin_step_graph(positions, bound, batch.chunks)
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
    return {"routed_layers": tuple(routed), "tokens": len(batch.chunks),
            **({"kv": kv} if kv.recurrent is not None else {})}


def record_step_routing(model, outputs):
    """After a step graph's launch: queue the read-back of its routing for the split's usage record."""
    if model.usage is not None and model.split is not None and outputs["routed_layers"]:
        model.split.defer_step_routing(model.backend.queue_step_routing(outputs["tokens"]), outputs["routed_layers"])
