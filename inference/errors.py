"""Errors the engine raises for the user's input (the CLI and the API turn them into messages)."""


class DocqaError(Exception):
    """Base for errors that are the user's to fix; ``str(e)`` is a one-line message."""

    code = "bad_request"


class ModelError(DocqaError):
    code = "model_error"


class PromptTooLongError(DocqaError):
    code = "prompt_too_long"

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit
