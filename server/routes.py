"""The Falcon WSGI app over a started engine: `create_app(engine, ...)`, for tests, `strata serve` and get_app."""
import falcon

from .anthropic import CountTokens, Messages
from .body import DEFAULT_MAX_BODY_BYTES, BodyLimit
from .errors import serialize_error
from .metrics import registry_for
from .resources import ApiKey, Completions, ExpertProfileResource, Health, Metrics, Models, Slots
from .tool_calls import dialect_for


def create_app(engine, model_id, api_key=None, description="", max_body_bytes=DEFAULT_MAX_BODY_BYTES):
    """`engine`: a started `hybrid.engine.Engine`; `model_id`: the name clients use in the `model` field;
    `max_body_bytes`: a larger request body is a 413, refused before it is read."""
    engine.tokenizer.prepare()
    dialect = dialect_for(engine.tokenizer.chat_template)
    engine.tokenizer.show_special(dialect.markers)  # the output parser reads them
    app = falcon.App(middleware=[BodyLimit(max_body_bytes), ApiKey(api_key)])
    app.set_error_serializer(serialize_error)
    app.add_route("/v1/chat/completions", Completions(engine, model_id, True, max_body_bytes, dialect))
    app.add_route("/v1/completions", Completions(engine, model_id, False, max_body_bytes, dialect))
    app.add_route("/v1/messages", Messages(engine, model_id, max_body_bytes, dialect))
    app.add_route("/v1/messages/count_tokens", CountTokens(engine, model_id, max_body_bytes, dialect))
    app.add_route("/v1/models", Models(model_id, description))
    app.add_route("/health", Health())
    app.add_route("/slots", Slots(engine))
    app.add_route("/metrics", Metrics(registry_for(engine)))
    app.add_route("/expert-profile", ExpertProfileResource(engine))
    return app
