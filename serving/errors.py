"""Error responses: `ApiError` (HTTP status, machine code, the field at fault, message), raised by validation,
admission and the routes alike, and the translation of the engine's `RequestError` into one."""

from __future__ import annotations

from qtts_jax.request import RequestError

# engine/Request field -> API field, so errors name what the caller sent
API_FIELD = {"text": "input", "speaker": "voice", "instruct": "instructions"}


class ApiError(Exception):
    """An error response: HTTP status, machine code, the offending field (or None), a message."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.retry_after = status, code, message, field, retry_after

    def body(self) -> dict:
        err = {"message": self.message, "type": _ERROR_TYPES.get(self.status, "server_error"), "code": self.code,
               "param": self.field}
        if self.retry_after is not None:
            err["retry_after"] = self.retry_after
        return {"error": err}

    def headers(self) -> dict[str, str]:
        """The headers its status calls for: Retry-After when a wait is known, WWW-Authenticate on a 401 (RFC 9110
        requires one)."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(int(self.retry_after))
        if self.status == 401:
            headers["WWW-Authenticate"] = 'Bearer realm="qtts-jax"'
        return headers


_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
                408: "invalid_request_error", 409: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def bad(field: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, code, f"{field}: {message}" if field else message, field)


def from_request_error(exc: RequestError) -> ApiError:
    field = API_FIELD.get(exc.field, exc.field)
    msg = str(exc).split(": ", 1)[-1]
    return bad(field, msg)
