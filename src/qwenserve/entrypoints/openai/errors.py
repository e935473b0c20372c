"""OpenAI-style errors: one exception type and one JSON envelope for every failure.

Clients (the ``openai`` package, LangChain, vLLM's own tools) read
``{"error": {"message", "type", "param", "code"}}`` and the HTTP status; vLLM uses this nested form
since v0.10.1, with ``type`` naming the error class (``BadRequestError``, ``NotFoundError``, ...).
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any

from qwenserve.sampling_params import SAMPLING_PARAM_NAMES

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error to report to the client; ``param`` names the offending request field."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    err_type = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def from_value_error(error: ValueError, param: str | None = None) -> OpenAIError:
    """A ``ValueError`` from SamplingParams or the engine is the client's fault: 400.

    SamplingParams' messages start with the field name ("top_p must be in (0, 1], got 2"), which
    becomes ``param`` so that clients can point at the field.
    """
    message = str(error)
    if param is None:
        first = message.split(" ", 1)[0].rstrip(":").split(".")[0]  # "field.key: why" too
        param = first if first in SAMPLING_PARAM_NAMES else None
    return OpenAIError(message, 400, param)


def context_length_error(
    max_model_len: int, num_prompt_tokens: int, max_tokens: int | None
) -> OpenAIError:
    """vLLM's newest wording; it contains "maximum context length is N tokens", which every
    older client-side matcher looks for."""
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of "
            "the input messages."
        )
    else:
        total = num_prompt_tokens + max_tokens
        message = (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_tokens} output tokens and your prompt contains at least "
            f"{num_prompt_tokens} input tokens, for a total of at least {total} tokens. "
            "Please reduce the length of the input prompt or the number of requested "
            "output tokens."
        )
    message += f" (parameter=input_tokens, value={num_prompt_tokens})"
    return OpenAIError(message, 400, "input_tokens")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(f"The model `{model}` does not exist.", 404, "model")


def internal_error(
    logger: logging.Logger, what: str, exc: BaseException, status: int = 500
) -> OpenAIError:
    """An unexpected failure: the traceback goes to the log under a reference id; the client
    gets only the id (exception types and messages can leak paths, keys or internals)."""
    reference = uuid.uuid4().hex[:12]
    logger.error("%s (reference %s)", what, reference, exc_info=(type(exc), exc, exc.__traceback__))
    message = f"Internal error, reference {reference}; the server log has the details"
    return OpenAIError(message, status)
