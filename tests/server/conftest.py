"""A real engine on the demo model (random weights, built into a temporary cache) for the server tests."""
import os

import pytest

MAX_CONTEXT = 256


@pytest.fixture(scope="session")
def demo_path(tmp_path_factory):
    from hybrid.demo import demo_model_path

    old = os.environ.get("STRATA_CACHE_DIR")
    os.environ["STRATA_CACHE_DIR"] = str(tmp_path_factory.mktemp("strata-cache"))
    try:
        return demo_model_path()
    finally:
        if old is None:
            del os.environ["STRATA_CACHE_DIR"]
        else:
            os.environ["STRATA_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def llm(demo_path):
    import hybrid

    return hybrid.LLM(demo_path, max_context=MAX_CONTEXT)


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
