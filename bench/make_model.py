"""Write a synthetic qwen3moe GGUF of a chosen size for benchmarks: random weights, skewed routers.

Weights are random valid blocks written directly in the file's types (Q8_0,
Q4_K_M's mix of Q4_K and Q6_K, or Q6_K), one tensor at a time, so a 16 GB
model never sits in RAM. Routers are skewed per layer: every token embedding
shares one direction, and each layer's router gives its experts a Zipf-like
bias along it (a different expert order per layer), so expert profiles look
like real ones (a few hot experts per layer, a long tail).

    python bench/make_model.py --type Q4_K_M -o /tmp/bench-q4km.gguf            # ~1.5 GB
    python bench/make_model.py --type Q8_0 --layers 48 -o /tmp/bench-16g.gguf   # ~16 GB variant
"""
import argparse
import logging
import os
import sys

import numpy as np
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.arch.base import expected_shape  # noqa: E402
from hybrid.arch.qwen3moe import SPEC  # noqa: E402
from hybrid.demo_tokenizer import build_demo_tokenizer  # noqa: E402
from hybrid.formats.gguf_writer import write_gguf  # noqa: E402
from hybrid.formats.synthetic import type_for  # noqa: E402
from hybrid.formats.weights import ModelConfig  # noqa: E402

ROUTER_SKEW = 3.0  # router bias strength: the top 25 % of a layer's experts get ~55 % of its routings
SHARED_DIRECTION_WEIGHT = 0.5  # share of each embedding row along the common direction


def model_config(args, vocab_size):
    return ModelConfig(
        arch="qwen3moe", vocab_size=vocab_size, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_ff, rope_theta=1e6, rms_norm_eps=1e-6,
        context_length=args.context, norm_topk_prob=True, tie_word_embeddings=False,
    )


class TensorMaker:
    """Builds each tensor's raw bytes when the writer asks for it (one tensor in RAM at a time)."""

    def __init__(self, config, target, seed):
        self.config, self.target, self.seed = config, target, seed
        rng = np.random.default_rng(seed)
        self.direction = rng.standard_normal(config.hidden_size).astype(np.float32)
        self.direction /= np.linalg.norm(self.direction)  # [H] shared by every token embedding

    def tensors(self):
        for index, name in enumerate(SPEC.required_tensor_names(self.config)):
            shape = expected_shape(name, self.config)
            qtype = type_for(name, shape, self.target)
            yield name, qtype, shape, (lambda n=name, s=shape, q=qtype, i=index: self.raw(n, s, q, i))

    def raw(self, name, shape, qtype, index):
        from cpu_kernels import format_for

        rng = np.random.default_rng((self.seed, index))
        if len(shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            return values.view(np.uint8)
        if name.endswith("ffn_gate_inp.weight"):
            return self.router(rng, shape).view(np.uint8)
        if name == "token_embd.weight":
            return self.embedding(rng, shape, qtype)
        return format_for(qtype).random_blocks(rng, shape, 1.0 / np.sqrt(shape[-1]))

    def router(self, rng, shape):
        """[E, H]: noise plus a per-expert bias along the shared direction, Zipf-like in a per-layer order."""
        num_experts, hidden = shape
        ranks = rng.permutation(num_experts) + 1  # a different hot set per layer
        bias = -ROUTER_SKEW * np.log(ranks) * np.sqrt(hidden)
        noise = rng.standard_normal(shape) / np.sqrt(hidden)
        return (noise + bias[:, None] * self.direction[None, :] / np.sqrt(hidden)).astype(np.float32)

    def embedding(self, rng, shape, qtype):
        from hybrid.formats.synthetic import encode

        values = rng.standard_normal(shape).astype(np.float32) * (1 - SHARED_DIRECTION_WEIGHT)
        values += SHARED_DIRECTION_WEIGHT * np.sqrt(shape[-1]) * self.direction[None, :]  # same norm as the noise
        return encode("token_embd.weight", values, qtype, rng).raw


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.add_argument("--type", default="Q4_K_M", choices=["Q8_0", "Q4_K_M", "Q6_K"], help="weight types")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-ff", type=int, default=768, help="expert FFN width (a multiple of 256 for K-quants)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    tokenizer = build_demo_tokenizer()
    config = model_config(args, tokenizer.vocab_size)
    maker = TensorMaker(config, args.type, args.seed)
    tensors = list(maker.tensors())
    bar = tqdm(total=len(tensors), desc=f"writing {os.path.basename(args.output)}", unit="tensor")

    def counted(make):
        def run():
            raw = make()
            bar.update(1)
            return raw
        return run

    tmp = f"{args.output}.tmp"
    write_gguf(tmp, config, [(n, q, s, counted(m)) for n, q, s, m in tensors], tokenizer,
               name=f"strata-bench-qwen3moe-{args.type}-RANDOM-WEIGHTS")
    os.replace(tmp, args.output)
    bar.close()
    logging.info("%s: %.2f GB", args.output, os.path.getsize(args.output) / 1e9)


if __name__ == "__main__":
    main()
