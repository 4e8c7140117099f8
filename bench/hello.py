"""The baseline: a Flask hello world, served exactly like the front door.

``GET /hello`` answers a small JSON body; ``POST /hello`` reads the JSON body
and answers ``201`` with a small JSON body, the shape of a submit.
"""

from __future__ import annotations

from flask import Flask, jsonify, request

app = Flask(__name__)


@app.get("/hello")
def hello_get():
    return jsonify(message="hello")


@app.post("/hello")
def hello_post():
    body = request.get_json(force=True, silent=True)
    return jsonify(received=isinstance(body, dict), message="hello"), 201
