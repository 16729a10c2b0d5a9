"""A real engine on the demo model (tests/conftest.py demo_llm) for the server tests."""
import threading

import pytest

MAX_CONTEXT = 256  # demo_llm's context (tests/conftest.py DEMO_MAX_CONTEXT)


@pytest.fixture(scope="session")
def llm(demo_llm):
    return demo_llm


@pytest.fixture(scope="session", params=[1, 4], ids=lambda n: f"{n}slots")
def engine(request, llm):
    from hybrid.engine import Engine

    engine = Engine(llm, num_slots=request.param).start()
    yield engine
    engine.stop()


@pytest.fixture
def client(engine):
    from falcon.testing import TestClient

    from server import create_app

    return TestClient(create_app(engine, "demo"))


SERVED_API_KEY = "served-key"


@pytest.fixture(scope="session")
def served(demo_path):
    """(base URL, engine): a 4-slot engine on the demo model behind `strata serve`'s waitress server, with
    API key SERVED_API_KEY, for the tests that talk to it with the official clients."""
    import hybrid
    from hybrid.engine import Engine
    from server import create_app
    from server.http import HttpServer
    from server.serve import listen_socket

    engine = Engine(hybrid.LLM(demo_path, max_context=1024), num_slots=4).start()
    sock = listen_socket("127.0.0.1", 0)
    http = HttpServer(create_app(engine, "demo", api_key=SERVED_API_KEY), [sock], parallel=4, max_queue=16,
                      max_connections=64)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    http.stop()
    thread.join(timeout=10)
    engine.stop()
