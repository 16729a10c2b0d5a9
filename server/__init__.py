"""The OpenAI-compatible HTTP server: a Falcon WSGI app over the engine, served by waitress."""
from .app import create_app, get_app

__all__ = ["create_app", "get_app"]
