"""Errors that reach users. Each message says what is wrong and how to fix it."""


class SpecserveError(Exception):
    """Base class of every error specserve raises on purpose."""


class InvalidRequestError(SpecserveError, ValueError):
    """A request (prompt or sampling parameters) cannot be served as given.

    `field` names the offending parameter so HTTP front-ends can report it.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigError(SpecserveError, ValueError):
    """An engine or speculative configuration field is invalid."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class ModelLoadError(SpecserveError):
    """A model, tokenizer or weight file cannot be found or read."""


class PromptFileError(SpecserveError, ValueError):
    """A prompt file is missing or holds a line that is not a prompt; the message names file and line."""


class QueueFullError(SpecserveError):
    """Too many requests are already waiting; the client should retry later."""


class RequestTimeoutError(SpecserveError):
    """The request ran past its deadline and was aborted."""


class EngineUnavailableError(SpecserveError):
    """The engine is starting, shutting down or has died; no request can be served."""
