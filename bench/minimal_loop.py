"""The minimal submit -> deliver -> collect loop from the bare parts (Flask, a Lua admission, ``send_task``,
a prefork Celery worker): full_cycle's baseline. Imports nothing from ``router_queue`` or ``workers``.
Configured by ``MINIMAL_REDIS_URL`` and ``MINIMAL_STUB_URL``; its routes, under ``/minimal/<variant>``,
mirror the queued ones: ``noop`` makes no provider call, ``stub`` one real call to the stub provider."""

import json
import os
import uuid

import redis
import requests
from celery import Celery
from flask import Flask, Response, request

REDIS_URL = os.environ.get("MINIMAL_REDIS_URL", "redis://127.0.0.1:6379/11")
STUB_URL = os.environ.get("MINIMAL_STUB_URL", "http://127.0.0.1:8001")
QUEUE, TASK, TTL_S = "minimal", "minimal.deliver", 3600
#: A Gemini-shaped answer of about the stub's size, the no-op call's output.
NOOP_ANSWER = json.dumps({
    "candidates": [{"content": {"role": "model", "parts": [{"inlineData": {
        "mimeType": "image/png", "data": "iVBORw0KGgo" + "A" * 300}}]}, "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 12, "candidatesTokenCount": 1290, "totalTokenCount": 1302},
    "modelVersion": "gemini-3.1-flash-image", "responseId": "noop",
}).encode()

client = redis.Redis.from_url(REDIS_URL)
#: The one admission script: the record, then its id.
admit = client.register_script("""
redis.call('HSET', KEYS[1], 'status', 'IN_QUEUE', 'body', ARGV[2], 'variant', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return ARGV[1]
""")
celery_app = Celery("minimal", broker=REDIS_URL)
celery_app.conf.update(task_acks_late=True, worker_prefetch_multiplier=1, task_ignore_result=True,
                       task_serializer="json", accept_content=["json"], task_default_queue=QUEUE,
                       broker_connection_retry_on_startup=True, worker_hijack_root_logger=False)
_session = None  # one requests.Session per worker process, made after the fork


def _provider_call(variant: str, body: bytes) -> bytes:
    global _session
    if variant != "stub":
        return NOOP_ANSWER
    _session = _session or requests.Session()
    response = _session.post(f"{STUB_URL}/v1/projects/bench/locations/us-central1/publishers/google/models/"
                             "gemini-3.1-flash-image:generateContent", data=body, timeout=30,
                             headers={"Authorization": "Bearer stub", "Content-Type": "application/json"})
    response.raise_for_status()
    return response.content


@celery_app.task(name=TASK, acks_late=True, ignore_result=True)
def deliver(request_id: str) -> None:
    body, variant = client.hmget(f"minimal:req:{request_id}", ("body", "variant"))
    output = _provider_call((variant or b"noop").decode(), body or b"{}")
    pipe = client.pipeline(transaction=True)
    pipe.set(f"minimal:result:{request_id}", output, ex=TTL_S)
    pipe.hset(f"minimal:req:{request_id}", "status", "COMPLETED")
    pipe.execute()


app = Flask(__name__)


def _json(payload: dict, status: int = 200) -> Response:
    return Response(json.dumps(payload), status, content_type="application/json")


@app.post("/minimal/<variant>")
def submit(variant: str) -> Response:
    request_id = uuid.uuid4().hex
    admit(keys=[f"minimal:req:{request_id}"], args=[request_id, request.get_data(), variant, TTL_S])
    celery_app.send_task(TASK, args=[request_id], queue=QUEUE)
    return _json({"request_id": request_id, "status": "IN_QUEUE"}, 201)


@app.get("/minimal/<variant>/<request_id>/status")
def status(variant: str, request_id: str) -> Response:
    if (value := client.hget(f"minimal:req:{request_id}", "status")) is None:
        return _json({"error": "not found"}, 404)
    return _json({"request_id": request_id, "status": value.decode()})


@app.get("/minimal/<variant>/<request_id>")
def result(variant: str, request_id: str) -> Response:
    if (output := client.get(f"minimal:result:{request_id}")) is None:
        return _json({"error": "not found"}, 404)
    return Response(output, 200, content_type="application/json")


@app.get("/healthz")
def healthz() -> Response:
    return _json({"ok": True})
