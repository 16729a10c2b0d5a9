"""`get_app()` for WSGI servers: the app of `strata serve`'s defaults and the STRATA_* environment."""
from .routes import create_app
from .serve import app_from_environment

__all__ = ["create_app", "get_app"]


def get_app():
    """For a WSGI server (`waitress-serve --listen 127.0.0.1:8080 --call server.app:get_app`): the defaults of
    `strata serve` with the settings of the STRATA_* environment (hybrid/config.py); a bad setting or model
    ends the process with one line."""
    from hybrid.errors import ModelError

    try:
        return app_from_environment()
    except (ModelError, ValueError) as exc:
        raise SystemExit(f"strata: error: {exc}") from None
