"""The state store: the only door to Redis.

Everything the service keeps lives in Redis and is read and written here:
requests and their schedule (``requests.py``, in parts ``requests_*.py``, and the Lua scripts in ``lua/``),
workspaces, keys and ledgers (``accounts.py``), the fleet's metrics
(``metrics.py``), the key layout (``keys.py``), what the scripts answer
(``outcomes.py``), and how a process connects, plainly or through Sentinel
(``connect.py``).
"""
