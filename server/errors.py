"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from sanic import response


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def to_response(self):
        return response.json(self.body(), status=self.status, headers=self.headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer <key>'.",
                    type="invalid_request_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})


def not_found(message: str, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


def model_loading() -> APIError:
    return APIError(503, "the model is still loading; retry shortly", type="server_error",
                    code="model_loading", headers={"Retry-After": "2"})
