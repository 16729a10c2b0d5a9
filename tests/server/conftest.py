"""A real engine on the demo model (tests/conftest.py demo_llm) for the server tests."""
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
