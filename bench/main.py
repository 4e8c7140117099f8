"""The router-queue benchmark (bench/README.md): runs the selected phases stage by stage and prints
one ``BENCH`` line per figure on stdout, everything else on stderr; stops every process it started."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import traceback
from contextlib import contextmanager
from pathlib import Path

from . import cluster, delivery, front, full_cycle, history, hostile, schedule, sync_held
from .core import (
    Children,
    Context,
    Fleet,
    MeasurementError,
    add_fleet_arguments,
    check_limits,
    ensure_tool,
    flush_quietly,
    log,
    ordered,
    start_redis,
    with_db,
)

#: Every module that adds phases (and their options); importing one registers its phases.
PHASE_MODULES = (front, hostile, history, schedule, full_cycle, cluster, delivery, sync_held)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [p.name for p in ordered()]
    parser = argparse.ArgumentParser(prog="bench/run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", "--phases", dest="only", default=",".join(names),
                        help=f"comma-separated phases: {', '.join(names)} (default all)")
    parser.add_argument("--redis-db", type=int, default=14,
                        help="database used (and flushed) on a shared server given by REDIS_URL")
    parser.add_argument("--side-dbs", default="12,13",
                        help="two more databases (flushed before and after) holding the two sides of the depth "
                             "and dispatch_cost figures (default 12,13)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with server logs")
    add_fleet_arguments(parser)
    for module in PHASE_MODULES:
        module.add_arguments(parser)
    args = parser.parse_args(argv)
    args.only = {p.strip() for p in args.only.split(",") if p.strip()}
    if unknown := args.only - set(names):
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    try:
        args.side_dbs = tuple(int(d) for d in args.side_dbs.split(","))
    except ValueError:
        parser.error("--side-dbs takes two database numbers, e.g. 12,13")
    if len(set(args.side_dbs)) != 2 or len(args.side_dbs) != 2 or {0, args.redis_db} & set(args.side_dbs):
        parser.error("--side-dbs takes two distinct database numbers, neither 0 nor --redis-db")
    check_limits(parser, args)
    for module in PHASE_MODULES:
        if hasattr(module, "check_arguments"):
            module.check_arguments(parser, args)
    return args


def start_redis_for(args, children: Children) -> tuple[str, bool]:
    """The bench's Redis URL: REDIS_URL's ``--redis-db``, else a private redis-server; and whether shared."""
    if os.environ.get("REDIS_URL"):
        if args.redis_db == 0:
            raise SystemExit("refusing to use (and flush) db 0 of a shared server; pass --redis-db N")
        log(f"using the Redis at REDIS_URL, database {args.redis_db} (flushed before and after)")
        return with_db(os.environ["REDIS_URL"], args.redis_db), True
    if (binary := ensure_tool("redis-server", "redis-server")) is None:
        raise SystemExit("redis-server is missing and apt-get could not install it; set REDIS_URL")
    redis_url = start_redis(children, binary)
    log(f"private redis-server at {redis_url}")
    return redis_url, False


@contextmanager
def stage(ctx: Context, name: str, failures: list[str]):
    """What a stage's phases run on: the front door, nothing more, or the fleet; stopped after."""
    if name == "front":
        ctx.front = front.FrontDoor(ctx)
        try:
            yield
        finally:
            failures += ctx.front.stop()
            ctx.front = None
    elif name == "fleet":
        ctx.fleet = Fleet(ctx.args, ctx.children, ctx.redis_url)
        ctx.fleet.start()
        yield
        if (dead := ctx.fleet.stack.exited()) is not None:
            log(f"ERROR: {dead} exited during the run; see {ctx.children.log_dir / (dead + '.log')}")
            failures.append(dead)
    else:
        yield


def run(args: argparse.Namespace, children: Children, tmp: Path) -> int:
    import redis

    redis_url, shared = start_redis_for(args, children)
    client = redis.Redis.from_url(redis_url)
    client.ping()
    ctx = Context(args, children, tmp, redis_url, tuple(with_db(redis_url, db) for db in args.side_dbs))
    chosen = [p for p in ordered() if p.name in args.only]
    flushed = [(client, args.redis_db)] if shared else []
    if shared and (side_phases := [p.name for p in chosen if p.side_dbs]):
        log(f"databases {args.side_dbs[0]} and {args.side_dbs[1]} there hold the two sides of "
            f"{', '.join(side_phases)} (flushed before and after)")
        flushed += [(redis.Redis.from_url(url), db) for db, url in zip(args.side_dbs, ctx.side_urls)]
    for db_client, db in flushed:
        # now, and after the servers stopped (requests still in their listen backlogs write to Redis)
        db_client.flushdb()
        children.after_stop.append(lambda c=db_client, d=db: flush_quietly(c, d))
    failures: list[str] = []
    ran: set[str] = set()
    for stage_name in dict.fromkeys(p.stage for p in chosen):
        if stage_name in ("own_fleet", "fleet") and ran & {"front", "own_fleet"}:
            client.flushdb()  # what earlier stages left must not reach this stage's workers
        with stage(ctx, stage_name, failures):
            for p in (p for p in chosen if p.stage == stage_name):
                try:
                    p.run(ctx)
                except MeasurementError as exc:
                    log(f"ERROR: {exc}")
                    failures.append(p.name)
        ran.add(stage_name)
    if failures:
        log(f"ERROR: no figure for: {', '.join(failures)}; logs in {children.log_dir}")
        return 1
    return 0


def _terminate(signum, _frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C, kill and a closed terminal all end in the same clean-up (SIGINT explicitly: a shell
    # starting us in the background leaves it ignored)
    for signum in SIGNALS:
        signal.signal(signum, _terminate)
    tmp = Path(tempfile.mkdtemp(prefix="router-queue-bench-"))
    children = Children(tmp)
    code = 1
    try:
        code = run(args, children, tmp)
    except KeyboardInterrupt:
        log("interrupted; stopping what was started")
        code = 130
    except (MeasurementError, RuntimeError, TimeoutError, OSError) as exc:
        log(f"ERROR: {exc}")
    except Exception:  # noqa: BLE001 - report, then still clean up
        traceback.print_exc(file=sys.stderr)
    finally:
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        children.stop_all()
        if args.keep_logs or code != 0:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
