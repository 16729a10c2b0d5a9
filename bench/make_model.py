"""Write a synthetic qwen3moe, glm4moe, gpt-oss or qwen3next GGUF of a chosen size for benchmarks: random weights,
skewed routers.

Weights are random valid blocks written directly in the file's types (one type,
or a mix of hybrid/formats/synthetic.py's MIXES: Q4_K_M, Q3_K_M, MXFP4_MOE,
UD_MIX), one tensor at a time, so a 16 GB model never sits in RAM. Routers are skewed per layer: every token embedding
shares one direction, and each layer's router gives its experts a Zipf-like
bias along it (a different expert order per layer), so expert profiles look
like real ones (a few hot experts per layer, a long tail).

Layers also differ in how skewed they are, as in real MoE models: layer l's
bias strength s (expert of rank r gets a logit offset of about -s*log(r)) is one
of the values evenly spaced over --router-skew LO,HI, dealt to the layers in a
seeded random order (deterministic for a --seed). With the default 0,3 the top
quarter of a layer's experts takes from ~45 % (nearly flat) to ~90 % (a few
experts take most routings) of its routings (64 experts, top-8, 16 layers);
`--router-skew 1.5` gives every layer the same strength. The token embedding is
written as Q8_0 (F16 for odd widths) when the main type has no encoder (K-quants:
random blocks would lose the shared direction the router bias reads).

    python bench/make_model.py --type Q4_K_M -o /tmp/bench-q4km.gguf            # ~1.5 GB
    python bench/make_model.py --type Q8_0 --layers 52 -o /tmp/bench-8g.gguf    # 8.5 GB (bench/gpu_model.py)
    python bench/make_model.py --type Q8_0 --layers 100 -o /tmp/bench-16g.gguf  # ~16 GB
    python bench/make_model.py --type IQ3_S --files 3 -o /tmp/bench-iq3s.gguf   # bench-iq3s-00001-of-00003.gguf ...
    # GLM-4.5-Air's shapes (hidden, heads, experts, top-k, widths, shared expert, a leading dense layer), 4 layers
    python bench/make_model.py --arch glm4moe --type Q4_K_M --layers 4 --hidden 4096 --heads 96 --kv-heads 8 \
        --head-dim 128 --experts 128 --top-k 8 --moe-ff 1408 --dense-ff 10944 -o /tmp/bench-glm-air.gguf
    # gpt-oss-120b's shapes (MXFP4 experts, Q8_0 the rest; sliding window 128, YaRN 32x of 4096), 2 layers
    python bench/make_model.py --arch gpt-oss --type MXFP4_MOE --layers 2 --hidden 2880 --heads 64 --kv-heads 8 \
        --head-dim 64 --experts 128 --top-k 4 --moe-ff 2880 -o /tmp/bench-gpt-oss-120b.gguf
    # Qwen3-Next-80B-A3B's shapes (3 Gated DeltaNet layers, then a gated full-attention one; a gated shared expert)
    python bench/make_model.py --arch qwen3next --type Q4_K_M --layers 4 --hidden 2048 --heads 16 --kv-heads 2 \
        --head-dim 256 --experts 512 --top-k 10 --moe-ff 512 -o /tmp/bench-qwen3next-80b.gguf
"""
import argparse
import logging
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybrid.arch import ARCHS  # noqa: E402
from hybrid.arch.base import expected_shape  # noqa: E402
from hybrid.demo_tokenizer import build_demo_tokenizer  # noqa: E402
from hybrid.formats.gguf_writer import write_gguf  # noqa: E402
from hybrid.formats.synthetic import GGUF_QUANTIZERS, MIXES, type_for  # noqa: E402
from hybrid.formats.weights import ModelConfig  # noqa: E402

DEFAULT_ROUTER_SKEW = (0.0, 3.0)  # per-layer router bias strengths, LO..HI: Zipf-like exponents
TYPES = ("Q8_0", "Q6_K", "IQ4_XS", "IQ3_S", "IQ2_XXS", "MXFP4", *MIXES)  # --type: a type or a mix
SHARED_DIRECTION_WEIGHT = 0.1  # share of each embedding row along the common direction (small: tokens stay apart)
SHARED_COS = SHARED_DIRECTION_WEIGHT / np.hypot(SHARED_DIRECTION_WEIGHT, 1 - SHARED_DIRECTION_WEIGHT)  # of a row, d


def hf_shaped_config(args, vocab_size):
    """gpt-oss / qwen3next: the family's own reading of an HF config.json with these shapes."""
    cfg = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
               num_key_value_heads=args.kv_heads, head_dim=args.head_dim, vocab_size=vocab_size,
               num_experts_per_tok=args.top_k, max_position_embeddings=args.context, tie_word_embeddings=False)
    if args.arch == "gpt-oss":
        from hybrid.arch.gpt_oss import config_from_hf

        cfg.update(num_local_experts=args.experts, intermediate_size=args.moe_ff, sliding_window=args.sliding_window,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
        return config_from_hf(cfg, "bench")
    from hybrid.arch.qwen3next import hf_config

    cfg.update(model_type="qwen3_next", num_experts=args.experts, moe_intermediate_size=args.moe_ff,
               shared_expert_intermediate_size=args.shared_experts * args.moe_ff, rope_theta=1e7,
               partial_rotary_factor=0.25, full_attention_interval=4, linear_num_key_heads=args.linear_heads[0],
               linear_num_value_heads=args.linear_heads[1], linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4)
    return hf_config(cfg, "bench")


def model_config(args, vocab_size):
    if args.arch in ("gpt-oss", "qwen3next"):
        return hf_shaped_config(args, vocab_size)
    glm = {} if args.arch == "qwen3moe" else dict(  # GLM-4.5's choices: q/k/v biases, half the head rotated
        attention_bias=True, rotary_dim=args.head_dim // 2, first_dense_layers=args.dense_layers,
        dense_intermediate_size=args.dense_ff, shared_intermediate_size=args.shared_experts * args.moe_ff)
    return ModelConfig(
        arch=args.arch, vocab_size=vocab_size, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_ff, rope_theta=1e6, rms_norm_eps=1e-6,
        context_length=args.context, norm_topk_prob=True, tie_word_embeddings=False, **glm,
    )


class TensorMaker:
    """Builds each tensor's raw bytes when the writer asks for it (one tensor in RAM at a time)."""

    def __init__(self, config, target, seed, router_skew=DEFAULT_ROUTER_SKEW, skew_spread="even"):
        self.config, self.target, self.seed = config, target, seed
        rng = np.random.default_rng(seed)
        self.direction = rng.standard_normal(config.hidden_size).astype(np.float32)
        self.direction /= np.linalg.norm(self.direction)  # [H] shared by every token embedding
        self.skews = layer_skews(router_skew, config.num_layers, rng, skew_spread)  # [L]

    def tensors(self):
        for index, name in enumerate(ARCHS[self.config.arch].required_tensor_names(self.config)):
            shape = expected_shape(name, self.config)
            qtype = type_for(name, shape, self.target)
            if name.endswith("ssm_conv1d.weight"):
                qtype = Q.F32  # as llama.cpp's converter keeps it (its conv op reads float32 weights)
            if name == "token_embd.weight" and qtype not in GGUF_QUANTIZERS:
                qtype = Q.Q8_0 if shape[-1] % 32 == 0 else Q.F16  # K-quants are written as random blocks
            yield name, qtype, shape, (lambda n=name, s=shape, q=qtype, i=index: self.raw(n, s, q, i))

    def raw(self, name, shape, qtype, index):
        from cpu_kernels.formats import format_for

        rng = np.random.default_rng((self.seed, index))
        if name.endswith(".ssm_a"):  # -exp(A_log): a decay, negative
            return (-np.exp(0.1 * rng.standard_normal(shape))).astype(np.float32).view(np.uint8)
        if len(shape) == 1:  # norms near 1, biases (q/k/v, the router's choice bias) near 0
            values = ((0.0 if name.endswith(".bias") else 1.0) + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            return values.view(np.uint8)
        if name.endswith("ffn_gate_inp.weight"):
            layer = int(name.split(".")[1])  # blk.{layer}.ffn_gate_inp.weight
            return self.router(rng, shape, self.skews[layer]).view(np.uint8)
        if name == "token_embd.weight":
            return self.embedding(rng, shape, qtype)
        return format_for(qtype).random_blocks(rng, shape, 1.0 / np.sqrt(shape[-1]))

    def router(self, rng, shape, skew):
        """[E, H]: noise plus a per-expert bias along the shared direction, Zipf-like in a per-layer order."""
        num_experts, hidden = shape
        ranks = rng.permutation(num_experts) + 1  # a different hot set per layer
        bias = -skew * np.log(ranks) / SHARED_COS  # [E]: along d, a normed token (norm ~sqrt(H)) gets ~-skew*log(rank)
        noise = rng.standard_normal(shape) / np.sqrt(hidden)  # a logit noise of ~unit variance per token
        return (noise + bias[:, None] * self.direction[None, :] / np.sqrt(hidden)).astype(np.float32)

    def embedding(self, rng, shape, qtype):
        from hybrid.formats.synthetic import encode

        values = rng.standard_normal(shape).astype(np.float32) * (1 - SHARED_DIRECTION_WEIGHT)
        values += SHARED_DIRECTION_WEIGHT * np.sqrt(shape[-1]) * self.direction[None, :]  # [V, H]
        return encode("token_embd.weight", values, qtype, rng).raw


def layer_skews(router_skew, num_layers, rng, spread="even"):
    """float [L]: LO..HI evenly spaced ("even") or half the layers LO and half HI ("two"), in a random
    order drawn from rng (the same values each run)."""
    lo, hi = router_skew
    order = rng.permutation(num_layers)
    if spread == "two":
        return np.where(order < num_layers // 2, lo, hi).astype(np.float64)
    return lo + (hi - lo) * order / max(num_layers - 1, 1)


def router_skew_range(text):
    """'LO,HI' or one value S (every layer S) -> (LO, HI), both >= 0."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI or one number, got {text!r}") from None
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not 0 <= values[0] <= values[1] or not np.isfinite(values).all():
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 <= LO <= HI, got {text!r}")
    return values


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", required=True, help="GGUF file to write")
    p.add_argument("--arch", default="qwen3moe", choices=["qwen3moe", "glm4moe", "gpt-oss", "qwen3next"],
                   help="the family (default qwen3moe)")
    p.add_argument("--sliding-window", type=int, default=128, help="gpt-oss: its sliding layers' window")
    p.add_argument("--linear-heads", type=lambda t: tuple(int(v) for v in t.split(",")), default=(16, 32),
                   metavar="K,V", help="qwen3next: the Gated DeltaNet's key and value heads (default 16,32)")
    p.add_argument("--dense-layers", type=int, default=1, help="glm4moe: leading dense layers (default 1)")
    p.add_argument("--dense-ff", type=int, default=4096, help="glm4moe: their FFN width (default 4096)")
    p.add_argument("--shared-experts", type=int, default=1,
                   help="glm4moe, qwen3next: shared experts' width in --moe-ff units")
    p.add_argument("--type", default="Q4_K_M", choices=TYPES, help="weight type, or a mix of types (default Q4_K_M)")
    p.add_argument("--files", type=int, default=1, help="a split model in this many files (llama.cpp's names)")
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
    p.add_argument("--router-skew", type=router_skew_range, default=DEFAULT_ROUTER_SKEW, metavar="LO,HI",
                   help="router bias strength per layer, spread evenly over LO..HI in a seeded order; one "
                        "number: every layer the same (default %s)" % ",".join(f"{v:g}" for v in DEFAULT_ROUTER_SKEW))
    p.add_argument("--router-skew-spread", choices=["even", "two"], default="even",
                   help="even: strengths evenly spaced over LO..HI; two: half the layers LO, half HI (layers "
                        "that differ the most, where per-layer placement matters most)")
    return p.parse_args(argv)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    tokenizer = build_demo_tokenizer()
    config = model_config(args, tokenizer.vocab_size)
    maker = TensorMaker(config, args.type, args.seed, args.router_skew, args.router_skew_spread)
    tensors = list(maker.tensors())
    bar = tqdm(total=len(tensors), desc=f"writing {os.path.basename(args.output)}", unit="tensor")

    def counted(make):
        def run():
            raw = make()
            bar.update(1)
            return raw
        return run

    tensors = [(n, q, s, counted(m)) for n, q, s, m in tensors]
    name = f"strata-bench-{args.arch}-{args.type}-RANDOM-WEIGHTS"
    if args.files > 1:
        paths = write_gguf(args.output, config, tensors, tokenizer, name=name, num_files=args.files)
    else:
        tmp = f"{args.output}.tmp"
        write_gguf(tmp, config, tensors, tokenizer, name=name)
        os.replace(tmp, args.output)
        paths = [args.output]
    bar.close()
    logging.info("%s: %.2f GB", ", ".join(paths), sum(os.path.getsize(p) for p in paths) / 1e9)


if __name__ == "__main__":
    main()
