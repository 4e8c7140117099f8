"""API keys: minted, resolved, listed, revoked and rotated, each change audited.

A key is shown once, when minted, and stored only as its SHA-256 (a 256-bit
random token needs no slow hash). It resolves to a workspace id, or ``-`` for
a legacy key; a record by key id holds what an operator sees, each workspace
indexes its key ids and keeps an audit list (``docs/KEYS.md``). The key id,
``key_`` and the first 16 hex digits of the hash, names a key without
revealing it. A legacy key is admitted under a namespace of its own,
``legacy:{key id}``, which a rotation hands on. ``docs/ARCHITECTURE.md``,
"The store's parts".
"""

from __future__ import annotations

import builtins  # builtins.list: the class's list() method shadows the name below it
import getpass
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis

from ..logs import AUDIT_LOGGER
from . import keys
from .connect import queue_script
from .scripts import argv, explain, load_script

log = logging.getLogger(AUDIT_LOGGER)

KEY_PREFIX = "rq_"
KEY_ID_PREFIX = "key_"
#: Hex digits of the key's SHA-256 in its id (64 bits: no two keys share one).
KEY_ID_HEX = 16
#: What a legacy key (one that belongs to no workspace) resolves to.
NO_WORKSPACE = "-"
#: A legacy key's own pseudo-workspace is this and its key id.
LEGACY_NAMESPACE = "legacy:"
#: Seconds between two writes of a key's last_used_at: a call costs no write.
LAST_USED_EVERY_S = 60
#: Audit lines kept per workspace (newest first).
AUDIT_KEPT = 1000
#: key_mint.lua's ARGV by name (``scripts.argv``), in order.
MINT_ARGS = ("workspace", "id", "hash", "label", "now", "audit_line", "audit_kept", "must_exist", "namespace")
#: key_rotate.lua's ARGV by name (``scripts.argv``), in order.
ROTATE_ARGS = ("workspace", "old_id", "old_hash", "new_id", "new_hash", "now", "label", "namespace", "until",
               "until_ms", "audit_line", "audit_kept")
#: key_resolve.lua's, key_revoke.lua's and key_adopt.lua's ARGV by name, in order.
RESOLVE_ARGS = ("now", "last_used_every_s")
REVOKE_ARGS = ("owner", "id", "audit_line", "audit_kept")
ADOPT_ARGS = ("owner", "id", "hash")
#: Seconds a rotated-out key keeps working beside its successor by default.
DEFAULT_OVERLAP_S = 86_400


def hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_id(digest: str) -> str:
    """The id of the key whose SHA-256 is ``digest``."""
    return KEY_ID_PREFIX + digest[:KEY_ID_HEX]


def legacy_namespace(of_key_id: str) -> str:
    return LEGACY_NAMESPACE + of_key_id


def is_legacy_namespace(workspace: str) -> bool:
    """Whether ``workspace`` is a legacy key's pseudo-workspace, not a workspace."""
    return workspace == NO_WORKSPACE or workspace.startswith(LEGACY_NAMESPACE)


@dataclass(frozen=True)
class KeyInfo:
    """What an operator sees of a key (never the key)."""

    id: str
    #: The workspace id, or ``NO_WORKSPACE`` for a legacy key.
    workspace: str
    label: str = ""
    created_at: float | None = None
    last_used_at: float | None = None
    #: When it stops working (a rotated-out key); None: no end.
    expires_at: float | None = None
    rotated_from: str = ""
    rotated_to: str = ""
    #: A legacy key's pseudo-workspace; "" for a workspace key.
    namespace: str = ""
    hash: str = ""


@dataclass(frozen=True)
class Resolved:
    """Who a presented key is, as the front door needs it."""

    #: The workspace id, or the legacy key's own namespace.
    workspace: str
    legacy: bool
    #: Seconds until it stops working; None: no end.
    left_s: float | None
    #: Its workspace's own rate limit (None: the default), when ``resolve``
    #: was asked for it (``rate_limit_read``).
    rate_limit: str | None = None
    rate_limit_read: bool = False


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _seconds(value: str | None) -> float | None:
    return float(value) if value else None


def _who() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "unknown"


class ApiKeys:
    def __init__(self, client: redis.Redis):
        self.client = client
        self._mint = load_script(client, "key_mint", MINT_ARGS)
        self._resolve = load_script(client, "key_resolve", RESOLVE_ARGS)
        self._revoke = load_script(client, "key_revoke", REVOKE_ARGS)
        self._rotate = load_script(client, "key_rotate", ROTATE_ARGS)
        self._adopt = load_script(client, "key_adopt", ADOPT_ARGS)

    # -- the front door ----------------------------------------------------
    def resolve(self, api_key: str, now: float | None = None, *,
                rate_limit_of: str | None = None) -> Resolved | None:
        """Who ``api_key`` is, or None; one round trip, and at most once a
        minute per key a write of when it was last used. ``rate_limit_of``:
        the workspace the key likely belongs to (what it resolved to last):
        its ``rate_limit`` is read in the same round trip, and answered
        (``Resolved.rate_limit_read``) when the key does belong to it."""
        digest = hash_key(api_key)
        ident = key_id(digest)
        key_names = [keys.api_key(digest), keys.key_record(ident)]
        args = argv(RESOLVE_ARGS, now=repr(now or time.time()), last_used_every_s=LAST_USED_EVERY_S)
        limit = None
        if rate_limit_of is None:
            reply = self._resolve(keys=key_names, args=args)
        else:
            reply, limit = self._resolve_with(key_names, args, keys.workspace(rate_limit_of))
        if not reply:
            return None
        owner, left_ms, namespace = _text(reply[0]), int(reply[1]), _text(reply[2])
        left_s = left_ms / 1000 if left_ms >= 0 else None
        if owner == NO_WORKSPACE:
            return Resolved(namespace or legacy_namespace(ident), True, left_s)
        if owner == rate_limit_of:
            return Resolved(owner, False, left_s, _text(limit) if limit else None, True)
        return Resolved(owner, False, left_s)

    def _resolve_with(self, key_names: builtins.list[str], args: builtins.list, workspace_key: str) -> tuple[Any, Any]:
        """key_resolve.lua's reply and a workspace's rate_limit, pipelined
        (``queue_script``); on NOSCRIPT, the plain call loads the script."""
        pipe = self.client.pipeline(transaction=False)
        queue_script(pipe, self._resolve, key_names, args)
        pipe.hget(workspace_key, "rate_limit")
        try:
            reply, limit = pipe.execute()
        except redis.exceptions.NoScriptError:
            return self._resolve(keys=key_names, args=args), self.client.hget(workspace_key, "rate_limit")
        except redis.exceptions.ResponseError as error:  # pipelined: raised here, not by the script
            raise explain(self._resolve, error) from None
        return reply, limit

    # -- the operator's commands -------------------------------------------
    def mint(self, workspace: str | None, *, label: str = "", now: float | None = None) -> tuple[str, KeyInfo]:
        """A new key for ``workspace`` (None: a legacy key) and what is kept
        of it; the only time the key is visible."""
        now = now or time.time()
        owner = workspace or NO_WORKSPACE
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(api_key)
        ident = key_id(digest)
        namespace = legacy_namespace(ident) if workspace is None else ""
        info = KeyInfo(ident, owner, label, now, namespace=namespace, hash=digest)
        reply = self._mint(
            keys=[keys.api_key(digest), keys.key_record(ident), keys.workspace_keys(owner), keys.key_audit(owner),
                  keys.workspaces()],
            args=argv(MINT_ARGS, workspace=owner, id=ident, hash=digest, label=label, now=repr(now),
                      audit_line=self._audit_line("mint", info, now), audit_kept=AUDIT_KEPT,
                      must_exist="0" if workspace is None else "1", namespace=namespace),
        )
        outcome = _text(reply[0])
        if outcome == "MISSING":
            raise LookupError(f"no workspace {workspace!r}")
        if outcome != "MINTED":
            raise RuntimeError(f"minting a key answered {outcome}")
        self._log("mint", info)
        return api_key, info

    def find(self, key_or_id: str) -> KeyInfo:
        """The live key named by its id or by the key itself; LookupError if
        there is none (never minted, revoked, or past its rotation's overlap)."""
        if key_or_id.startswith(KEY_ID_PREFIX):
            ident, digest, owner = key_or_id, None, None
        else:
            digest = hash_key(key_or_id)
            ident = key_id(digest)
            value = self.client.get(keys.api_key(digest))
            owner = _text(value) if value is not None else None
        fields = {_text(k): _text(v) for k, v in self.client.hgetall(keys.key_record(ident)).items()}
        owner = owner or fields.get("workspace")
        digest = digest or fields.get("hash")
        if not owner or not digest or not self.client.exists(keys.api_key(digest)):
            raise LookupError(f"no key {ident} (never minted, revoked, or past its rotation's overlap)")
        return self._info(ident, {**fields, "workspace": owner, "hash": digest})

    def list(self, workspace: str, now: float | None = None) -> list[KeyInfo]:
        """The workspace's live keys (``-``: the legacy keys), oldest first."""
        now = now or time.time()
        ids = [_text(i) for i in self.client.zrangebyscore(keys.workspace_keys(workspace), f"({now!r}", "+inf")]
        pipe = self.client.pipeline(transaction=False)
        for ident in ids:
            pipe.hgetall(keys.key_record(ident))
        found = [self._info(ident, {_text(k): _text(v) for k, v in fields.items()})
                 for ident, fields in zip(ids, pipe.execute()) if fields]
        return sorted(found, key=lambda k: (k.created_at or 0.0, k.id))

    def revoke(self, key_or_id: str, now: float | None = None) -> KeyInfo:
        """The key stops working (on every front door within its cache's TTL)."""
        now = now or time.time()
        info = self.find(key_or_id)
        reply = self._revoke(
            keys=[keys.api_key(info.hash), keys.key_record(info.id), keys.workspace_keys(info.workspace),
                  keys.key_audit(info.workspace)],
            args=argv(REVOKE_ARGS, owner=info.workspace, id=info.id, audit_line=self._audit_line("revoke", info, now),
                      audit_kept=AUDIT_KEPT),
        )
        if _text(reply[0]) != "REVOKED":
            raise LookupError(f"no key {info.id} (revoked meanwhile)")
        self._log("revoke", info)
        return info

    def rotate(self, key_or_id: str, *, overlap_s: float = DEFAULT_OVERLAP_S,
               now: float | None = None) -> tuple[str, KeyInfo, KeyInfo]:
        """A successor for the key (same workspace and label; a legacy key's
        namespace too); the old key works beside it for ``overlap_s`` seconds
        (0: it stops now). Returns the new key, the old key's and the new one's info."""
        now = now or time.time()
        old = self.find(key_or_id)
        api_key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(api_key)
        ident = key_id(digest)
        namespace = (old.namespace or legacy_namespace(old.id)) if old.workspace == NO_WORKSPACE else ""
        until = now + overlap_s if overlap_s > 0 else None
        new = KeyInfo(ident, old.workspace, old.label, now, rotated_from=old.id, namespace=namespace, hash=digest)
        ended = KeyInfo(old.id, old.workspace, old.label, old.created_at, old.last_used_at, until, old.rotated_from,
                        ident, old.namespace, old.hash)
        line = self._audit_line("rotate", ended, now, successor=ident, overlap_s=overlap_s)
        reply = self._rotate(
            keys=[keys.api_key(old.hash), keys.key_record(old.id), keys.api_key(digest), keys.key_record(ident),
                  keys.workspace_keys(old.workspace), keys.key_audit(old.workspace)],
            args=argv(ROTATE_ARGS, workspace=old.workspace, old_id=old.id, old_hash=old.hash, new_id=ident,
                      new_hash=digest, now=repr(now), label=old.label, namespace=namespace,
                      until=repr(until) if until else "", until_ms=int(until * 1000) if until else "",
                      audit_line=line, audit_kept=AUDIT_KEPT),
        )
        outcome = _text(reply[0])
        if outcome == "ROTATED_ALREADY":
            stops = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(_text(reply[2]) or now)))
            raise LookupError(f"{old.id} was rotated already (to {_text(reply[1]) or '?'}) and stops at {stops}; "
                              "rotate its successor, or revoke it to end the overlap now")
        if outcome != "ROTATED":
            raise LookupError(f"no key {old.id} (revoked meanwhile)")
        self._log("rotate", ended, successor=ident, overlap_s=overlap_s)
        return api_key, ended, new

    def audit(self, workspace: str, count: int = 100) -> builtins.list[dict]:
        """The workspace's last key changes, newest first."""
        return [json.loads(line) for line in self.client.lrange(keys.key_audit(workspace), 0, count - 1)]

    def index_unrecorded(self) -> int:
        """Give every key minted before keys had records one, and its place in
        its workspace's index; once (then marked done). Returns how many."""
        if self.client.exists(keys.keys_indexed()):
            return 0
        adopted = 0
        prefix = keys.api_key("")
        batch: list[bytes] = []

        def adopt(names: list[bytes]) -> int:
            values = self.client.mget(names)
            count = 0
            for name, value in zip(names, values):
                if value is None:
                    continue
                digest, owner = _text(name)[len(prefix):], _text(value)
                ident = key_id(digest)
                reply = self._adopt(keys=[_text(name), keys.key_record(ident), keys.workspace_keys(owner)],
                                    args=argv(ADOPT_ARGS, owner=owner, id=ident, hash=digest))
                count += _text(reply[0]) == "ADOPTED"
            return count

        for name in self.client.scan_iter(match=prefix + "*", count=1000):
            batch.append(name)
            if len(batch) >= 500:
                adopted += adopt(batch)
                batch = []
        if batch:
            adopted += adopt(batch)
        self.client.set(keys.keys_indexed(), repr(time.time()))
        return adopted

    # -- audit -------------------------------------------------------------
    @staticmethod
    def _audit_line(action: str, info: KeyInfo, now: float, **more) -> str:
        return json.dumps({"at": now, "action": action, "key_id": info.id, "workspace": info.workspace,
                           "label": info.label, "by": _who(), **more}, separators=(",", ":"))

    @staticmethod
    def _log(action: str, info: KeyInfo, **more) -> None:
        log.info("key %s: %s of %s", action, info.id, info.workspace,
                 extra={"audit": "key", "action": action, "key_id": info.id, "workspace": info.workspace,
                        "label": info.label, "by": _who(), **more})

    @staticmethod
    def _info(ident: str, fields: dict[str, str]) -> KeyInfo:
        return KeyInfo(
            id=ident, workspace=fields.get("workspace", ""), label=fields.get("label", ""),
            created_at=_seconds(fields.get("created_at")), last_used_at=_seconds(fields.get("last_used_at")),
            expires_at=_seconds(fields.get("expires_at")), rotated_from=fields.get("rotated_from", ""),
            rotated_to=fields.get("rotated_to", ""), namespace=fields.get("namespace", ""),
            hash=fields.get("hash", ""),
        )
