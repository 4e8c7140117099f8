"""A request's model, plain data that never reads Redis: its record's fields,
declared once, with the record and the submission (``record``), what the
request store's calls take and answer (``values``) and what the scripts
answer, by name (``outcomes``). The store (``store/requests*.py``) keeps them
in Redis; the front door and the workers read them."""
