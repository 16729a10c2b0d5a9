"""llguidance vs xgrammar on this machine: vocabulary setup, schema compile and next-token mask time per step.

Each library gets the same tokenizer (a `tokenizers` JSON: the demo model's 1K vocabulary, and a ~150K
byte-level BPE trained here on Python sources when `--big` is given) and the same JSON schema (a delivery
note: strings, enums, a date pattern, numbers with bounds, an array of line items). The step time is the
median over one walk through a valid document (its BPE tokens), mask computed then the token consumed,
at 1 slot and at 4 slots (the library's own batched call, 4 documents walked side by side).

    python -m bench.grammar_libs [--big PATH.json] [--repeats 5]

xgrammar needs torch and transformers; install it where they are (pip install xgrammar) to compare.
"""
import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["note_id", "date", "customer", "status", "items", "total"],
    "properties": {
        "note_id": {"type": "string", "pattern": "^DN-[0-9]{6}$"},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "customer": {"type": "object", "additionalProperties": False, "required": ["name", "city"],
                     "properties": {"name": {"type": "string", "maxLength": 40},
                                    "city": {"type": "string", "maxLength": 30}}},
        "status": {"type": "string", "enum": ["packed", "shipped", "delivered", "returned"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 20,
                  "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                            "properties": {"sku": {"type": "string", "maxLength": 12},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "price": {"type": "number", "minimum": 0}}}},
        "total": {"type": "number", "minimum": 0},
        "remarks": {"type": "string", "maxLength": 200},
    },
}


def without(schema, keyword):
    """`schema` with `keyword` dropped everywhere."""
    if isinstance(schema, dict):
        return {k: without(v, keyword) for k, v in schema.items() if k != keyword}
    return schema


SCHEMAS = {"bounded strings": SCHEMA, "free strings": without(SCHEMA, "maxLength")}


def documents(n):
    """n valid documents of SCHEMA, compact JSON."""
    docs = []
    for i in range(n):
        items = [{"sku": f"SKU{i}{j:03d}", "qty": 3 + j, "price": 12.5 * (j + 1)} for j in range(3 + i % 3)]
        docs.append(json.dumps({"note_id": f"DN-00012{i}", "date": "2026-12-06",
                                "customer": {"name": f"Acme Widgets {i}", "city": "Rotterdam"},
                                "status": "shipped", "items": items,
                                "total": sum(x["qty"] * x["price"] for x in items),
                                "remarks": "Leave at the back door, ring twice."}, separators=(",", ":")))
    return docs


def load_tokenizer(path):
    from tokenizers import Tokenizer

    if path is None:
        from hybrid.demo_tokenizer import build_demo_tokenizer

        tok = build_demo_tokenizer()
        return tok.backend, sorted(tok.eos_ids)
    backend = Tokenizer.from_file(path)
    return backend, [backend.token_to_id("<|endoftext|>"), backend.token_to_id("<|im_end|>")]


class LLGuidance:
    name = "llguidance"

    def __init__(self, backend, eos):
        import llguidance
        import llguidance.numpy as llnp

        self.llg, self.llnp = llguidance, llnp
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema):
        from hybrid.grammar import JSON_OPTIONS

        return self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled, log_level=0)

    def masks(self, matchers, out):
        self.llnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], out)

    def consume(self, matcher, token):
        assert matcher.consume_token(token), matcher.get_error()

    def bitmask(self, n):
        return self.llnp.allocate_token_bitmask(n, self.vocab_size)


class XGrammar:
    name = "xgrammar"

    def __init__(self, backend, eos):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        hf = PreTrainedTokenizerFast(tokenizer_object=backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=20)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def masks(self, matchers, out):
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(out, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, out)

    def consume(self, matcher, token):
        assert matcher.accept_token(token)

    def bitmask(self, n):
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)


def walk(lib, backend, schema, num_slots):
    """Per-step mask times (s) of num_slots documents walked side by side."""
    compiled = lib.compile(schema)
    docs = [backend.encode(d, add_special_tokens=False).ids for d in documents(num_slots)]
    matchers = [lib.matcher(compiled) for _ in docs]
    out = lib.bitmask(num_slots)
    times = []
    for step in range(min(map(len, docs))):
        t0 = time.perf_counter()
        lib.masks(matchers, out)
        times.append(time.perf_counter() - t0)
        for m, d in zip(matchers, docs):
            lib.consume(m, d[step])
    return times


def measure(lib, backend, schema, repeats):
    compile_s = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        lib.matcher(lib.compile({**schema, "description": f"fresh {time.perf_counter()}"}))  # no cache hit
        compile_s.append(time.perf_counter() - t0)
    row = {"compile_ms": statistics.median(compile_s) * 1e3}
    for n in (1, 4):
        steps = [t for _ in range(repeats) for t in walk(lib, backend, schema, n)]
        row[f"mask_us_{n}"] = statistics.median(steps) * 1e6
        row[f"mask_mean_us_{n}"] = statistics.mean(steps) * 1e6
        row[f"mask_p95_us_{n}"] = float(np.percentile(steps, 95)) * 1e6
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", help="a tokenizer.json with a real-size vocabulary")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    libs = [LLGuidance]
    try:
        import xgrammar  # noqa: F401

        libs.append(XGrammar)
    except ImportError:
        print("xgrammar is not installed: llguidance only")
    for path in [None] + ([args.big] if args.big else []):
        backend, eos = load_tokenizer(path)
        for lib_cls in libs:
            t0 = time.perf_counter()
            lib = lib_cls(backend, eos)
            setup = {"library": lib.name, "vocab": lib.vocab_size, "setup_ms": (time.perf_counter() - t0) * 1e3}
            for name, schema in SCHEMAS.items():
                row = {**setup, "schema": name, **measure(lib, backend, schema, args.repeats)}
                print(" | ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
