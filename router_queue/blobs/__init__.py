"""The object store beside Redis: big results (and later big bodies) live
there, Redis keeps a pointer. ``OBJECT_STORE_URL`` names it (``s3://``,
``gs://``, ``file://``); unset, everything stays in Redis.

``offhub`` keeps its native I/O off a gevent hub, ``store`` is the client,
``pointers`` says what Redis keeps about one object and how objects are
named.
"""
