"""The OpenAI-compatible HTTP server: a Falcon WSGI app over the engine, served by waitress."""
from .app import get_app
from .routes import create_app

__all__ = ["create_app", "get_app"]
