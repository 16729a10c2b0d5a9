"""The MoE block, written once: route (top-k), run the chosen experts, combine.

Shape legend: T tokens, H hidden, E experts, K experts per token.
"""


def moe_block(backend, spec, layer, h):
    """h [T, H] (normed hidden) -> expert mixture [T, H]."""
    router_logits = backend.linear(layer.router, h)  # [T, E]
    ids, weights = backend.route(router_logits, layer.num_experts_per_tok, layer.norm_topk_prob)  # [T, K]
    return backend.experts(h, ids, weights, layer.gate_exps, layer.up_exps, layer.down_exps)  # [T, H]
