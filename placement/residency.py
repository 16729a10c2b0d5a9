"""Residency rules: which experts a GPU's expert cache holds when no profile plans it.
Shape legend: L layers, E experts."""
import numpy as np


def default_residency(bytes_per_expert, num_experts, budget):
    """mask bool [L, E]: whole layers first, in order, then the first experts of the next layer."""
    mask = np.zeros((len(bytes_per_expert), num_experts), dtype=bool)  # [L, E]
    left = budget
    for layer, size in enumerate(bytes_per_expert):
        if size == 0:  # no routed experts (a dense layer, another GPU's layer)
            continue
        count = min(num_experts, left // size)
        mask[layer, :count] = True
        left -= count * size
        if count < num_experts:
            break
    return mask


def even_residency(bytes_per_expert, num_experts, budget):
    """mask bool [L, E]: the same number of experts in every layer (the first ones), as many as fit."""
    per_layer = min(num_experts, int(budget // max(sum(bytes_per_expert), 1)))
    mask = np.zeros((len(bytes_per_expert), num_experts), dtype=bool)  # [L, E]
    mask[:, :per_layer] = True
    return mask
