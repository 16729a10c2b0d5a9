"""A whole decode step of one-token chunks as one device graph (GraphRunner's fast path; the GPU's is
hybrid/backends/gpu_step.py): one sequence's next token, or up to MAX_STEP_TOKENS users' at once.

Taken when nothing in the step needs the host's hand: the backend declares `step_graph`, every step of every
layer is capturable or may run inside a step graph (hybrid/blocks.py Step.step_graph), the split is not traced,
the backend accepts the sequences' KV, and every expert is resident, or (the split's relay_graphs) the layers with
host experts go through the decode relay (hybrid/moe_relay.py): the graph posts their routing to the host and waits
for their rows inside it, reading the step's number from the device, and their host jobs are submitted before the
graph is launched, so that each wait is answered. The routing the usage record needs is copied inside the graph
and read back once a step.
Shape legend: n chunks of one token each, H hidden, K top-k.
"""

from .blocks import carries_residual, carry_residual

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


def step_graph_plan(model, batch):
    """(keys bound, relayed layers) of a step graph for this batch of one-token chunks, or None where the step needs
    the host: the relayed layers' host experts run through the relay while the graph waits (none where every expert
    is resident)."""
    be, split = model.backend, model.split
    if split is not None and split.trace is not None or not step_tokens_fit(model, batch):
        return None
    c = model.config
    relayed = [] if split is None else split.relay.graph_layers(be, model.layers, split.resident, len(batch.chunks),
                                                                c.hidden_size, c.num_experts_per_tok)
    if relayed is None:
        return None
    bound = be.prepare_step_graph(batch.chunks, len(model.layers), c.num_experts_per_tok)
    return None if bound is None else (bound, relayed)


def relay_key(model, relayed):
    """What a step graph's relayed part depends on beyond its token count: the mailbox it posts to, and per layer
    whether it relays and whether the device has experts of it (an expert-cache change may change either)."""
    if not relayed:
        return None
    resident = model.split.resident
    return model.split.relay.version, resident.all(axis=1).tobytes(), resident.any(axis=1).tobytes()


def run_step(model, graphs, key, batch, relayed, queue):
    """graphs.run_step(key, queue) (gpu_layer_graphs.LayerGraphs) with the relayed layers' host jobs of this step
    submitted first: the graph (or its first, uncaptured run) waits on the host for their rows."""
    relay = model.split.relay if relayed else None
    if relay is not None:
        relay.submit_step(model.backend, relayed, model.split.resident, model.split.step_number, len(batch.chunks))
    try:
        return graphs.run_step(model.backend, key, queue)
    finally:
        if relay is not None:
            relay.end_step()


def queue_step(model, x, batch, steps_of, positions, bound):
    """Every layer's steps over x [n, H] with the positions read on the device; returns the graph's outputs: the
    (routing row, layer index) of the layers whose routing the graph keeps (with a usage record), the token count,
    and a KV with a recurrent state (its graph is its own: held so that its id stays its own)."""
    be, keep_routing, routed = model.backend, model.usage is not None, []
    carried = None  # the last layer's y, its residual add left to this layer's first norm (blocks.carry_residual)
    be.begin_step_graph(positions, bound, batch.chunks)
    try:
        for i, layer in enumerate(model.layers):
            s = {"x": x, "batch": batch, "split": model.split, "usage": None}
            steps = steps_of(i)
            last = len(steps) - 1
            if i + 1 < len(model.layers) and carries_residual(steps, steps_of(i + 1), be):
                last -= 1
            for j, step in enumerate(steps[:last + 1]):
                if j == 0 and carried is not None:
                    carry_residual(be, layer, s, carried, step)
                else:
                    step.run(be, layer, s)
            carried = s["y"] if last < len(steps) - 1 else None
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
