"""Train a NextN (MTP) layer for the frozen tiny-code-moe and write the model with it as a GGUF Strata loads.

The layer is the DeepSeek / GLM form hybrid/speculative/mtp.py runs: z = eh_proj([rmsnorm(embed(x_{p+1}), enorm);
rmsnorm(h_p, hnorm)]), a qwen3moe decoder layer over the positions p (causal), shared_head_norm, the model's own
head; trained to predict x_{p+2} with cross-entropy, the main model (embeddings, head, h_p: its last layer's
output before the final norm) frozen. Data: the model's training split only (the standard library's files whose
path's SHA-1 is not divisible by 20, as its README says), each written as its training text was; the held-out
files give the validation loss. The decoder layer starts as a copy of the model's last layer, shared_head_norm as
its final norm, eh_proj as [0, I] (the main hidden row passed through).

    nice python bench/train_mtp.py --model ../shared/models/tiny-code-moe --out /tmp/strata/mtp/tiny-code-moe-mtp.gguf

CPU, torch: about 10 minutes with --threads 1 on a loaded 2-core machine. The output is a model file: never committed.
"""
import argparse
import copy
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.placement_heldout import STDLIB, stdlib_files  # noqa: E402

LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.experts.down_proj": "ffn_down_exps.weight"}


def file_texts(held_out, eos):
    """The files' texts as the model's training text wrote them (header, text, end token)."""
    texts = []
    for path in stdlib_files(held_out):
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f"# file: ./{os.path.relpath(path, STDLIB)}\n{f.read()}{eos}")
    return texts


def token_rows(tokenizer, texts, seq, max_rows, rng):
    """Up to max_rows rows of seq token ids [R, seq]: texts in random order, joined, cut in rows."""
    ids, total = [], 0
    for i in rng.permutation(len(texts)):
        ids.append(np.asarray(tokenizer.encode(texts[i]).ids, dtype=np.int64))
        total += len(ids[-1])
        if total >= max_rows * seq:
            break
    ids = np.concatenate(ids)
    return ids[:min(len(ids) // seq, max_rows) * seq].reshape(-1, seq)


def main_hidden(model, rows, batch=8):
    """The frozen model's last-layer output before its final norm [R, seq, H] (float32)."""
    import torch

    seen = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    out = []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            model(torch.from_numpy(rows[i:i + batch]))
            out.append(seen["h"].float())
    hook.remove()
    return torch.cat(out)


class NextN:
    """The trainable NextN layer around a copy of the model's last decoder layer (torch modules)."""

    def __init__(self, model):
        import torch
        from torch import nn

        h = model.config.hidden_size
        self.layer = copy.deepcopy(model.model.layers[-1]).float()
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        with torch.no_grad():
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:] = torch.eye(h)
        self.enorm = nn.Parameter(torch.ones(h))
        self.hnorm = nn.Parameter(torch.ones(h))
        self.head_norm = nn.Parameter(model.model.norm.weight.detach().float().clone())
        self.model, self.eps = model, model.config.rms_norm_eps

    def parameters(self):
        return [*self.layer.parameters(), *self.eh_proj.parameters(), self.enorm, self.hnorm, self.head_norm]

    def _norm(self, x, w):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def logits(self, ids, hidden):
        """ids x_{p+1} [B, T], hidden h_p [B, T, H] -> logits of x_{p+2} [B, T, V]."""
        import torch

        e = self._norm(self.model.model.embed_tokens(ids).float(), self.enorm)
        z = self.eh_proj(torch.cat([e, self._norm(hidden, self.hnorm)], -1))
        positions = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        out = self.layer(z, position_embeddings=self.model.model.rotary_emb(z, positions), attention_mask=None,
                         position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(self._norm(out, self.head_norm))

    def loss(self, rows, hidden):
        import torch.nn.functional as F

        logits = self.logits(rows[:, 1:-1], hidden[:, :-2])  # positions p = 0 .. T-3
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 2:].reshape(-1))

    def gguf_tensors(self, layer):
        """{GGUF name: float32 array} of the trained layer as blk.{layer}.*."""
        state = {k: v.detach().float().numpy() for k, v in self.layer.state_dict().items()}
        out = {f"blk.{layer}.{LAYER_NAMES[k]}": v for k, v in state.items() if k in LAYER_NAMES}
        gate_up = state["mlp.experts.gate_up_proj"]  # [E, 2F, H]: gate rows, then up rows
        width = gate_up.shape[1] // 2
        out[f"blk.{layer}.ffn_gate_exps.weight"] = gate_up[:, :width]
        out[f"blk.{layer}.ffn_up_exps.weight"] = gate_up[:, width:]
        out[f"blk.{layer}.nextn.eh_proj.weight"] = self.eh_proj.weight.detach().numpy()
        for name, p in (("enorm", self.enorm), ("hnorm", self.hnorm), ("shared_head_norm", self.head_norm)):
            out[f"blk.{layer}.nextn.{name}.weight"] = p.detach().numpy()
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_model(model_dir, nextn, path):
    """The HF directory's model (F32) with the NextN layer as a GGUF (qwen3moe, nextn_predict_layers = 1)."""
    from hybrid.formats import load_model
    from hybrid.formats.gguf_writer import write_gguf
    from hybrid.formats.synthetic import encode_model
    from hybrid.weight_formats import dequantize

    weights = load_model(model_dir)
    config = dataclasses.replace(weights.config, num_nextn_layers=1)
    floats = {name: dequantize(t).astype(np.float32) for name, t in weights.tensors.items()}
    floats.update(nextn.gguf_tensors(config.num_layers))
    tensors = encode_model(floats, "F32", np.random.default_rng(0))
    write_gguf(path, config, tensors.values(), weights.tokenizer, name="tiny-code-moe-mtp")


def check(path, nextn, rows, hidden):
    """Largest difference of Strata's MTP logits (hybrid/speculative/mtp.py on the written file) from the trained
    module's over one row's first 64 positions, relative to the largest logit."""
    import torch

    from hybrid.backends import CpuBackend
    from hybrid.formats import load_model
    from hybrid.model import Model
    from hybrid.speculative.mtp import MtpHead

    head = MtpHead(Model(load_model(path), CpuBackend(act_quant="float")))
    kv, n = head.new_sequence(128), 64
    got, _ = head.run(kv, 0, rows[0, 1:n + 1].numpy(), hidden[0, :n].numpy())
    with torch.no_grad():
        want = nextn.logits(rows[:1, 1:n + 1], hidden[:1, :n])[0, -1].numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="tiny-code-moe's HF directory")
    p.add_argument("--out", required=True, help="GGUF file to write (model + NextN layer)")
    p.add_argument("--rows", type=int, default=1280, help="training rows of --seq tokens (about steps x batch: "
                   "passes over fewer rows overfit, the held-out loss rising after ~100 steps over 400 rows)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    eos = "<|endoftext|>"
    t0 = time.perf_counter()
    train_rows = token_rows(tokenizer, file_texts(False, eos), args.seq, args.rows, rng)
    val_rows = token_rows(tokenizer, file_texts(True, eos), args.seq, 48, rng)
    train_h, val_h = main_hidden(model, train_rows), main_hidden(model, val_rows)
    train_rows, val_rows = torch.from_numpy(train_rows), torch.from_numpy(val_rows)
    print(f"{len(train_rows)} training rows, {len(val_rows)} held-out rows of {args.seq} tokens; main model's hidden "
          f"rows in {time.perf_counter() - t0:.0f} s", flush=True)
    nextn = NextN(model)
    params = nextn.parameters()
    for param in params:
        param.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)

    def validation():
        with torch.no_grad():
            return float(np.mean([nextn.loss(val_rows[i:i + 8], val_h[i:i + 8]).item()
                                  for i in range(0, len(val_rows), 8)]))

    print(f"step 0: held-out loss {validation():.3f}", flush=True)
    for step in range(1, args.steps + 1):
        pick = torch.from_numpy(rng.integers(0, len(train_rows), args.batch))
        loss = nextn.loss(train_rows[pick], train_h[pick])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == args.steps:
            print(f"step {step}: training loss {loss.item():.3f}, held-out loss {validation():.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    write_model(args.model, nextn, args.out)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s); Strata's MTP layer on it vs the trained module: "
          f"{check(args.out, nextn, val_rows, val_h):.1e} of the largest logit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
