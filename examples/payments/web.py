"""The payments web app: ``POST /charges`` with an ``Idempotency-Key`` header, ``GET /charges/<task_id>``.

Run it with ``flask --app examples.payments.web run`` (Flask finds ``create_app``), or
``gunicorn "examples.payments.web:create_app()"``.

- A new key: the charge is queued, ``202 Accepted`` with its task id.
- The same key and body again (a client retry after a timeout, a double click): nothing is queued;
  the answer names the ORIGINAL task id, with ``Idempotent-Replayed: true``, and once the charge
  is done, its stored outcome (``200``).
- The same key with another body: ``422``, as Stripe answers a reused key.
- A missing or malformed key (1-255 printable characters, no whitespace): ``400``.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery
from celery.result import AsyncResult
from flask import Flask, Response, jsonify, request
from kombu.exceptions import OperationalError

from celery_idem import InvalidKeyError, PayloadMismatchError, StoreUnavailableError

from .tasks import CHARGE, make_celery


def _error(status: int, code: str, message: str) -> tuple[Response, int]:
    return jsonify(error=code, message=message), status


def _parse_charge(body: Any) -> tuple[str, int] | str:
    """``(order_id, amount)`` from the JSON body, or what is wrong with it."""
    if not isinstance(body, dict):
        return 'the body must be a JSON object: {"order_id": "...", "amount": 1999}'
    order_id, amount = body.get("order_id"), body.get("amount")
    if isinstance(order_id, int) and not isinstance(order_id, bool):
        order_id = str(order_id)  # 42 and "42" are one order: one fingerprint
    if not isinstance(order_id, str) or not 0 < len(order_id) <= 64:
        return "order_id must be a string of 1-64 characters (or an integer)"
    if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
        return "amount must be a positive integer, in minor units (cents)"
    return order_id, amount


def describe(result: AsyncResult) -> dict[str, Any]:
    """A charge as the API shows it: its task id, Celery state, and result or error once done."""
    state = result.state
    body: dict[str, Any] = {"task_id": result.id, "status": state}
    if state in ("SUCCESS", "FAILURE"):
        # Ready: no wait. A replayed charge answers from the idempotency store, others from the backend.
        outcome = result.get(timeout=5, propagate=False)
        body["result" if state == "SUCCESS" else "error"] = outcome if state == "SUCCESS" else repr(outcome)
    return body


def create_app(celery_app: Celery | None = None) -> Flask:
    """The web app; by default with a Celery app configured from the ``PAYMENTS_*`` variables."""
    celery_app = celery_app if celery_app is not None else make_celery()
    charge = celery_app.tasks[CHARGE]
    web = Flask(__name__)

    @web.post("/charges")
    def create_charge() -> Any:
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return _error(400, "missing_idempotency_key", "send an Idempotency-Key header with every charge")
        parsed = _parse_charge(request.get_json(silent=True))
        if isinstance(parsed, str):
            return _error(400, "invalid_request", parsed)
        order_id, amount = parsed
        try:
            result = charge.apply_async((order_id, amount), idempotency_key=key)
        except InvalidKeyError as exc:
            return _error(400, "invalid_idempotency_key", str(exc))
        except PayloadMismatchError:
            return _error(
                422,
                "idempotency_key_reused",
                "this Idempotency-Key was used with other parameters; use a new key for a new charge",
            )
        except (StoreUnavailableError, OperationalError):  # the store or the broker is down: retry later
            return _error(503, "unavailable", "cannot take charges right now; retry with the same key")
        body = {**describe(result), "idempotency_key": key, "deduplicated": result.deduplicated}
        status = 200 if result.deduplicated and body["status"] in ("SUCCESS", "FAILURE") else 202
        response = jsonify(body)
        response.status_code = status
        response.headers["Location"] = f"/charges/{result.id}"
        if result.deduplicated:
            response.headers["Idempotent-Replayed"] = "true"
        return response

    @web.get("/charges/<task_id>")
    def show_charge(task_id: str) -> Any:
        try:
            uuid.UUID(task_id)
        except ValueError:
            return _error(404, "not_found", "no such charge")
        return jsonify(describe(charge.AsyncResult(task_id)))

    @web.get("/healthz")
    def healthz() -> Any:
        return jsonify(status="ok")

    return web
