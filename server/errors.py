"""Errors the router returns: OpenAI's error object, a status, and a message that says what to fix.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unknown_model(requested: str, served: str) -> APIError:
    return APIError(404, f"model {requested!r} does not exist here; this server serves {served!r} "
                    f"(see GET /v1/models)", "invalid_request_error", "model", "model_not_found")


def no_worker(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "no_worker")


def worker_failed(message: str, code: str = "worker_error") -> APIError:
    """A worker reported an error or vanished mid-request."""
    return APIError(502, message, "server_error", None, code)


def timed_out(message: str) -> APIError:
    return APIError(504, message, "timeout", None, "timeout")
