"""The baseline: a Flask hello world served like the front door (``GET``/``POST /hello``, and
``GET /hello/redis``: the same plus one Redis ``INCR``, the floor under a status read)."""

import os

import redis
from flask import Flask, jsonify, request

app = Flask(__name__)
_redis = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                              socket_connect_timeout=2, socket_timeout=5, health_check_interval=30)


@app.get("/hello")
@app.get("/healthz")
def hello_get():
    return jsonify(message="hello")


@app.get("/hello/redis")
def hello_redis():
    return jsonify(message="hello", count=_redis.incr("bench:hello"))


@app.post("/hello")
def hello_post():
    return jsonify(received=isinstance(request.get_json(force=True, silent=True), dict), message="hello"), 201
