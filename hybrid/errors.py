"""Errors that Strata reports to users in one line."""


class ModelError(Exception):
    """A model file or directory cannot be used: the message names the file and the problem."""


class RequestError(ValueError):
    """A request cannot be served as asked (e.g. a prompt longer than the context)."""
