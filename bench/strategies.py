"""What the one-step path buys on a single Redis (issue 34, item 3): a request's whole life through
the store (admit, load, claim, complete), once as one Redis runs it (``admit.lua`` in one step) and
once split per slot as a Redis Cluster must (``store/admission.py``'s three steps, ``store/owed.py``'s
owed effects), both on the bench's one private redis-server. Figures: the admission's latency (p50
and p99: while it is in flight a fault leaves its outcome to be read back, so it is also the window a
fault can hit), Redis CPU and Redis commands per request, each split against one-step."""

import time

from router_queue.requests.record import Submission
from router_queue.services import Services
from router_queue.settings import Settings

from . import core
from .core import Context, MeasurementError, emit, log, phase
from .schedule import bench_lease

#: Requests per round and side (after a warm-up of WARMUP), rounds, workspaces admitted round-robin.
CYCLES, WARMUP, ROUNDS, WORKSPACES = 1000, 200, 5, 10
BODY = '{"prompt": "a red teapot"}'


class Path:
    """One side: a store on its own database, split or not, its provider capped at 1 so that each
    request is granted as it is admitted and its completion frees the slot for the next."""

    def __init__(self, label: str, redis_url: str, catalog_path, split: bool):
        settings = Settings.from_env({"REDIS_URL": redis_url, "CATALOG_PATH": str(catalog_path)})
        self.label, self.services = label, Services.build(settings, split=split)
        entry = self.services.catalog.by_id(core.MODEL_ID)
        if entry is None:
            raise MeasurementError(f"{core.MODEL_ID} is not in the bench's catalog copy")
        self.client, self.entry = self.services.redis, entry
        self.client.flushdb()
        self.granted: list[str] = []  # no broker: the grants reach this list (the Dispatcher's place)
        self.services.store.grants.publish = lambda provider, ids: self.granted.extend(ids)
        self.workspaces = [core.new_workspace(self.services, f"bench-paths-{n}") for n in range(WORKSPACES)]
        self.turn = 0

    def run(self, cycles: int) -> tuple[list[float], float, int]:
        """``cycles`` requests through their whole life: (admission latencies s, Redis CPU s, Redis commands)."""
        store, lease, admit_s = self.services.store, bench_lease(), []
        cpu0, commands0 = core.redis_cpu(self.client), self._commands()
        for _ in range(cycles):
            workspace = self.workspaces[self.turn % WORKSPACES]
            self.turn += 1
            request_id = self.services.ids.mint(workspace, self.entry.id)
            began = time.perf_counter()
            admission = store.admit(Submission(request_id=request_id, workspace=workspace, model=self.entry.id,
                                               provider=self.entry.provider, body=BODY,
                                               price=self.entry.price_credits))
            admit_s.append(time.perf_counter() - began)
            if admission.outcome != "ADMITTED" or admission.position != 0:
                raise MeasurementError(f"{self.label}: admission answered {admission}")
            record, _ = store.load(request_id)
            if record is None:
                raise MeasurementError(f"{self.label}: the admitted {request_id} has no record")
            if (claimed := store.claim(record, lease)) != "CLAIMED":
                raise MeasurementError(f"{self.label}: claim answered {claimed}")
            if (done := store.complete(record, output=b"{}", content_type="application/json")) != "COMPLETED":
                raise MeasurementError(f"{self.label}: complete answered {done}")
        cpu = core.redis_cpu(self.client) - cpu0
        return admit_s, cpu, self._commands() - commands0 - 2  # the two INFO calls

    def _commands(self) -> int:
        return int(self.client.info("stats")["total_commands_processed"])


@phase("consistency_paths", "store", 30)
def measure_consistency_paths(ctx: Context) -> None:
    catalog_path = core.capped_catalog(ctx.tmp, {"bfl": 1})
    one, split = (Path(label, ctx.db_url(db), catalog_path, flag)
                  for label, db, flag in (("one step", core.SIDE_DBS[0], False), ("split", core.SIDE_DBS[1], True)))
    for side in (one, split):
        side.run(WARMUP)
    rounds = [(one.run(CYCLES), split.run(CYCLES)) for _ in range(ROUNDS)]
    base, subject = core.median_round("split_admit_latency_p50", rounds,
                                      lambda b, s: core.pct(s[0], 0.5) / core.pct(b[0], 0.5))
    emit("split_admit_latency_p50", 1000 * core.pct(subject[0], 0.5), "ms", 1000 * core.pct(base[0], 0.5))
    emit("split_admit_latency_p99", 1000 * core.pct(subject[0], 0.99), "ms", 1000 * core.pct(base[0], 0.99))
    base, subject = core.median_round("split_redis_cpu_per_request", rounds, lambda b, s: s[1] / b[1])
    emit("split_redis_cpu_per_request", 1e6 * subject[1] / CYCLES, "us", 1e6 * base[1] / CYCLES)
    emit("split_redis_commands_per_request", subject[2] / CYCLES, "commands", base[2] / CYCLES)
    for side in (one, split):
        log(f"consistency_paths {side.label}: {side.turn} requests through admit, load, claim, complete")
        side.client.flushdb()
