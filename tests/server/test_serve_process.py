"""The real `strata serve` process on the demo model, driven with the official `openai` client."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")

API_KEY = "test-key"


def get(url):
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})  # /slots needs the key
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def busy_slots(base):
    return [s for s in json.loads(get(f"{base}/slots"))["slots"] if s["state"] != "idle"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strata_command():
    strata = shutil.which("strata", path=os.path.dirname(sys.executable))
    return [strata] if strata else [sys.executable, "-m", "hybrid.cli"]


@pytest.fixture(scope="module")
def served(demo_path, tmp_path_factory):
    """The server process, its base URL, its log and the --profile-out it saves when it stops."""
    port = free_port()
    folder = tmp_path_factory.mktemp("serve")
    log_path, profile_out = folder / "serve.log", folder / "usage.npz"
    with open(log_path, "w") as log:
        process = subprocess.Popen(strata_command() + [
            "serve", "--model", demo_path, "--parallel", "4", "--port", str(port), "--api-key", API_KEY,
            "--max-context", "4096", "--profile-out", str(profile_out)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, log_path.read_text()
            assert time.time() < deadline, log_path.read_text()
            try:
                get(f"{base}/health")
                break
            except OSError:
                time.sleep(0.2)
        yield SimpleNamespace(base=base, process=process, log_path=log_path, profile_out=profile_out)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(served):
    return served.base


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)


def model_id(client):
    return client.models.list().data[0].id


def test_models_label_the_demo(client):
    model = client.models.list().data[0]
    assert "RANDOM" in model.id


def test_chat_stream_and_not(client):
    messages = [{"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=model_id(client), messages=messages, max_tokens=8, temperature=0)
    assert whole.usage.completion_tokens >= 1 and whole.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=model_id(client), messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_four_concurrent_clients(client):
    prompts = ["Hello there", "One two three", "abc", "The quick brown fox"]

    def ask(prompt):
        return client.completions.create(model=model_id(client), prompt=prompt, max_tokens=8, temperature=0)

    alone = [ask(p).choices[0].text for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = [r.choices[0].text for r in pool.map(ask, prompts)]
    assert together == alone


def test_disconnect_mid_stream_frees_the_slot(client, server):
    # long enough (seconds) that the request cannot finish before the disconnect is noticed
    stream = client.completions.create(model=model_id(client), prompt="Hello", max_tokens=4000, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):  # the first chunk leaves before the engine admits the request; text comes from a slot
        next(chunks)
    assert busy_slots(server)
    stream.close()
    deadline = time.time() + 10
    while busy_slots(server):
        assert time.time() < deadline, "the slot of a disconnected client was not freed"
        time.sleep(0.05)
    assert 'strata_requests_total{reason="cancelled"}' in get(f"{server}/metrics")


def test_wrong_api_key(server):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bad_request_through_openai(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id(client), prompt="Hi", max_tokens=4, n=2)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=4)


def test_a_taken_port_is_one_line_before_the_model_loads(demo_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(strata_command() + ["serve", "--model", demo_path, "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"strata: error: port {port} on 127.0.0.1 is already in use\n"


def test_an_address_the_os_refuses_is_named():
    from server.serve import listen_socket

    with pytest.raises(ValueError, match=r"^cannot listen on port 8080 of 192.0.2.1: Cannot assign requested"):
        listen_socket("192.0.2.1", 8080)  # TEST-NET-1: an address of no machine here


def test_sigterm_saves_the_profile_out(served):
    # the last test of this module: it stops the shared server
    client = openai.OpenAI(base_url=f"{served.base}/v1", api_key=API_KEY)
    client.completions.create(model=model_id(client), prompt="Hello", max_tokens=2)
    served.process.terminate()
    assert served.process.wait(timeout=60) == 0, served.log_path.read_text()
    from placement.profile import ExpertProfile

    profile = ExpertProfile.load(served.profile_out)
    assert profile.tokens_prefill > 0, served.log_path.read_text()
    assert "SIGTERM: shutting down" in served.log_path.read_text()
