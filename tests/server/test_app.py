"""The Falcon app on a real engine (demo model), over 1 and 4 slots."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from falcon.testing import TestClient

from server import create_app

from .conftest import MAX_CONTEXT

TIMING_FIELDS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n", "prompt_per_second",
                 "predicted_per_second"}
PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog", "One two three four", "abc"]


def greedy(max_tokens=8, **extra):
    return {"max_tokens": max_tokens, "temperature": 0, **extra}


def sse_events(result):
    lines = [line for line in result.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_chat_completion(client):
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], **greedy()}
    result = client.simulate_post("/v1/chat/completions", json=body)
    assert result.status_code == 200, result.text
    out = result.json
    assert out["object"] == "chat.completion" and out["model"] == "demo"
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert set(out["timings"]) == TIMING_FIELDS
    assert out["timings"]["predicted_n"] == usage["completion_tokens"]


def test_completion_equals_llm_generate(client, llm):
    expected = llm.generate(PROMPTS[1], max_tokens=8, temperature=0)
    out = client.simulate_post("/v1/completions", json={"prompt": PROMPTS[1], **greedy()}).json
    assert out["choices"][0]["text"] == expected.text
    assert out["usage"]["completion_tokens"] == len(expected.token_ids)
    assert out["timings"]["prompt_n"] == len(expected.prompt_token_ids)


def test_concurrent_requests_equal_each_alone(client, llm):
    expected = [llm.generate(p, max_tokens=10, temperature=0).text for p in PROMPTS]

    def ask(prompt):
        return client.simulate_post("/v1/completions", json={"prompt": prompt, **greedy(10)}).json

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = [out["choices"][0]["text"] for out in pool.map(ask, PROMPTS)]
    assert got == expected


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/v1/completions", {"prompt": "Once upon"}),
])
def test_streaming_equals_non_streaming(client, path, body):
    body = {**body, **greedy()}
    whole = client.simulate_post(path, json=body).json
    result = client.simulate_post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert result.status_code == 200 and result.headers["content-type"].startswith("text/event-stream")
    events = sse_events(result)
    usage, final = events[-1], events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert set(final["timings"]) == TIMING_FIELDS
    if path.endswith("chat/completions"):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == whole["choices"][0]["message"]["content"]
    else:
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]


def test_stop_string_cuts_text(client, llm):
    full = llm.generate(PROMPTS[0], max_tokens=12, temperature=0).text
    stop = full[4:6]
    body = {"prompt": PROMPTS[0], **greedy(12), "stop": [stop]}
    out = client.simulate_post("/v1/completions", json=body).json
    assert out["choices"][0]["text"] == full[: full.find(stop)]
    assert out["choices"][0]["finish_reason"] == "stop"
    events = sse_events(client.simulate_post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == full[: full.find(stop)]


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "Hi", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": True}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "stop": [1]}, 400, "stop"),
    ("/v1/completions", {"prompt": {"text": "Hi"}}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, None),
    ("/v1/completions", {"prompt": "Hi", "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {"messages": "Hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": list(range(MAX_CONTEXT + 1))}, 400, "prompt"),
])
def test_bad_requests(client, path, body, status, param):
    kwargs = {"body": body} if isinstance(body, bytes) else {"json": body}
    result = client.simulate_post(path, **kwargs)
    assert result.status_code == status, result.text
    error = result.json["error"]
    assert error["message"] and error["type"] and error["param"] == param


def test_api_key(engine):
    client = TestClient(create_app(engine, "demo", api_key="secret"))
    body = {"prompt": "Hi", **greedy(2)}
    assert client.simulate_post("/v1/completions", json=body).status_code == 401
    wrong = client.simulate_post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json["error"]["code"] == "invalid_api_key"
    assert client.simulate_get("/v1/models").status_code == 401
    right = client.simulate_post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert right.status_code == 200
    assert client.simulate_get("/health").status_code == 200


def test_models_health_slots_metrics(client, engine):
    assert client.simulate_get("/v1/models").json["data"][0]["id"] == "demo"
    assert client.simulate_get("/health").json == {"status": "ok"}
    slots = client.simulate_get("/slots").json
    assert len(slots["slots"]) == len(engine.scheduler.slots) and slots["queue_length"] == 0
    client.simulate_post("/v1/completions", json={"prompt": "Hi", **greedy(2)})
    metrics = client.simulate_get("/metrics").text
    for name in ("strata_requests_total", "strata_generated_tokens_total", 'strata_slots{state="idle"}',
                 "strata_queue_length", "strata_prompt_tokens_per_second", "strata_decode_tokens_per_second"):
        assert name in metrics


def test_expert_profile_of_live_traffic(client, engine):
    import io

    from placement.profile import ExpertProfile

    client.simulate_post("/v1/completions", json={"prompt": "Hello there, how are", **greedy(3)})
    result = client.simulate_get("/expert-profile")
    assert result.status_code == 200 and "expert-profile.npz" in result.headers["content-disposition"]
    profile = ExpertProfile.load(io.BytesIO(result.content))
    config = engine.model.config
    profile.check_model(config.num_layers, config.num_experts)
    assert profile.tokens_prefill > 0 and profile.tokens_decode > 0 and profile.sources == ["serve"]
    assert profile.counts("decode").sum() >= profile.tokens_decode * config.num_experts_per_tok  # every layer's K
    counts = client.simulate_get("/expert-profile", params={"format": "json"}).json
    assert counts["num_layers"] == config.num_layers and len(counts["decode"][0]) == config.num_experts
    assert counts["tokens_decode"] >= profile.tokens_decode
    assert sum(map(sum, counts["prefill"])) >= profile.counts("prefill").sum()
    bad = client.simulate_get("/expert-profile", params={"format": "csv"})
    assert bad.status_code == 400 and bad.json["error"]["param"] == "format"


def test_queue_full_is_429(llm):
    from hybrid.engine import Engine

    client = TestClient(create_app(Engine(llm, num_slots=1, max_queue=0), "demo"))  # never started: nothing runs
    result = client.simulate_post("/v1/completions", json={"prompt": "Hi"})
    assert result.status_code == 429 and result.headers["retry-after"]
    assert result.json["error"]["type"] == "rate_limit_error"
