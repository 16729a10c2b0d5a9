"""Serving with the conversation cache: a returning conversation is restored, metrics show it."""
import re

import numpy as np
from falcon.testing import TestClient

from hybrid.conversation_cache import ConversationCache, model_fingerprint
from hybrid.engine import Engine
from server import create_app
from server.serve import save_profile


def metric(text, name):
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_returning_conversation_is_restored_and_counted(llm, tmp_path):
    cache = ConversationCache(64 << 20, model_fingerprint(llm.weights), block_tokens=16)
    engine = Engine(llm, num_slots=2, conversation_cache=cache).start()
    try:
        client = TestClient(create_app(engine, "demo"))
        ids = np.random.default_rng(0).integers(0, llm.config.vocab_size, 80).tolist()
        body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        first = client.simulate_post("/v1/completions", json=body).json
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        again = client.simulate_post("/v1/completions", json={**body, "prompt": ids + [5, 6, 7]}).json
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        assert again["timings"]["cache_n"] == 80 and again["timings"]["prompt_n"] == 3
        text = client.simulate_get("/metrics").text
        assert metric(text, "strata_conversation_cache_hits_total") == 1
        assert metric(text, "strata_conversation_cache_restored_tokens_total") == 80
        assert metric(text, "strata_conversation_cache_entries") == 2  # the follow-up diverged at token 80
        assert metric(text, "strata_conversation_cache_bytes") == cache.bytes_used > 0
        assert metric(text, "strata_conversation_cache_state_bytes") == cache.state_bytes == 0  # no linear attention
        assert metric(text, 'strata_expert_routings_total{phase="prefill"}') > 0
        assert metric(text, 'strata_expert_routings_total{phase="decode"}') > 0
        path = str(tmp_path / "served.npz")
        save_profile(engine, llm.weights, path)
        save_profile(engine, llm.weights, path)  # a second save merges into the first
        from placement.profile import ExpertProfile

        profile = ExpertProfile.load(path)
        assert profile.tokens_decode == 2 * engine.usage.tokens_decode > 0
    finally:
        engine.stop()
