"""The Falcon WSGI app: `create_app(engine, ...)` for tests and `strata serve`, `get_app()` for WSGI servers."""
import os

import falcon

from .errors import serialize_error
from .metrics import registry_for
from .resources import ApiKey, Completions, ExpertProfileResource, Health, Metrics, Models, Slots


def create_app(engine, model_id, api_key=None, description=""):
    """`engine`: a started `hybrid.engine.Engine`; `model_id`: the name clients use in the `model` field."""
    app = falcon.App(middleware=[ApiKey(api_key)])
    app.set_error_serializer(serialize_error)
    app.add_route("/v1/chat/completions", Completions(engine, model_id, chat=True))
    app.add_route("/v1/completions", Completions(engine, model_id, chat=False))
    app.add_route("/v1/models", Models(model_id, description))
    app.add_route("/health", Health())
    app.add_route("/slots", Slots(engine))
    app.add_route("/metrics", Metrics(registry_for(engine)))
    app.add_route("/expert-profile", ExpertProfileResource(engine))
    return app


def get_app():
    """For a WSGI server (`waitress-serve --call server.app:get_app`): settings from STRATA_* variables."""
    from .serve import build

    env = os.environ.get
    max_context = env("STRATA_MAX_CONTEXT")
    app, _ = build(model=env("STRATA_MODEL"), parallel=int(env("STRATA_PARALLEL", "1")),
                   api_key=env("STRATA_API_KEY"), max_context=int(max_context) if max_context else None)
    return app
