"""Diagnostics of call B's failure (session 51): test_decode_path.py's three-user relay test hit cudaErrorInvalidValue
in the logits' to_host. The same steps under variants, each a fresh LLM, every step synchronized; the report names each
variant's first failing step (or its error against the CPU engine). Temporary: removed once the cause is known."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 17, 42, 5, 99], [23, 64, 7, 11, 250, 31], [8, 77, 120, 45]]


def _steps(model, sync):
    from hybrid.batch import Batch, SeqChunk

    kvs = [model.new_sequence(64) for _ in PROMPTS]
    for i, (kv, p) in enumerate(zip(kvs, PROMPTS)):
        model.forward(Batch([SeqChunk(kv, 0, np.asarray(p), "last")]))
        sync(f"prompt {i}")
    out = []
    for s in range(3):
        batch = Batch([SeqChunk(kv, kv.length, np.asarray([19 + s + u])) for u, kv in enumerate(kvs)])
        out.append(model.forward(batch))
        sync(f"step {s}")
    return np.concatenate(out)


def test_three_users_through_the_relay_variants(runtime, gguf_models):
    from hybrid import LLM

    path, _ = gguf_models("small", "Q8_0")
    cpu = LLM(path, device="cpu", max_context=256)
    ref = _steps(cpu.model, lambda _: None)
    c = cpu.config
    masks = {0: np.zeros((c.num_layers, c.num_experts), bool),
             50: np.random.default_rng(1).random((c.num_layers, c.num_experts)) < 0.5,
             100: np.ones((c.num_layers, c.num_experts), bool)}
    variants = [("0 % traced", 0, True, True, {}), ("50 % traced", 50, True, True, {}),
                ("100 % traced", 100, True, True, {}), ("0 % untraced", 0, True, False, {}),
                ("50 % untraced", 50, True, False, {}), ("0 % relay off", 0, False, True, {}),
                ("50 % no borrow", 50, True, True, dict(prefill_borrow=False)),
                ("0 % relay graphs", 0, True, False, dict(relay_graphs=True))]
    report = []
    for name, share, relay, traced, settings in variants:
        where = "load"
        try:
            with LLM(path, device="gpu", max_context=256, kv_sequences=3, resident=masks[share], **settings) as gpu:
                split, be = gpu.model.split, gpu.model.backend
                split.relay.enabled, split.relay.tokens = relay, 3
                split.trace = [] if traced else None

                def sync(what):
                    nonlocal where
                    where = what
                    be.synchronize()
                    failed = split.relay.worker.mailbox.device_error() if split.relay.worker is not None else None
                    assert failed is None, f"device relay error {failed}"

                got = _steps(gpu.model, sync)
                err = np.abs(got - ref).max() / np.abs(ref).max()
                report.append(f"{name}: ok, rel err {err:.1e}, path {gpu.model.runner.last_path}")
        except Exception as exc:
            report.append(f"{name}: FAILED at {where}: {type(exc).__name__}: {exc}")
    print("\n".join(report))
    assert all(": ok" in line for line in report), "\n".join(report)
