"""The router-queue benchmark (bench/README.md): runs the selected phases stage by stage and prints
one ``BENCH`` line per figure on stdout, everything else on stderr; stops every process it started."""

import argparse
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from . import batches, delivery, front, objects, own_fleet, pools, schedule, strategies
from .core import Children, Context, Fleet, MeasurementError, log, ordered, start_redis

#: Every module that adds phases; importing one registers its phases.
PHASE_MODULES = (front, schedule, strategies, own_fleet, pools, batches, objects, delivery)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [p.name for p in ordered()]
    parser = argparse.ArgumentParser(prog="bench/run", description=__doc__)
    parser.add_argument("--only", "--phases", dest="only", default=",".join(names),
                        help=f"comma-separated phases: {', '.join(names)} (default all)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the temp dir with server logs")
    args = parser.parse_args(argv)
    args.only = {p.strip() for p in args.only.split(",") if p.strip()}
    if unknown := args.only - set(names):
        parser.error(f"unknown phase(s): {', '.join(sorted(unknown))}")
    return args


def run(args: argparse.Namespace, children: Children, tmp: Path) -> int:
    import redis

    ctx = Context(children, tmp, start_redis(children))
    chosen = [p for p in ordered() if p.name in args.only]
    failures = []
    for stage in dict.fromkeys(p.stage for p in chosen):
        if stage != "front" and stage != "store":  # what earlier stages published must reach no worker
            redis.Redis.from_url(ctx.redis_url).flushdb()
        with children.scope():  # what a stage started stops with it: the next must not share the machine
            if stage == "front":
                ctx.front = front.FrontDoor(ctx)
            if stage == "objects":  # its own object store and a fleet whose big results go there
                ctx.fleet = objects.start(ctx)
            if stage == "fleet":
                ctx.fleet = Fleet(children, ctx.redis_url).start()
            for p in (p for p in chosen if p.stage == stage):
                try:
                    p.run(ctx)
                except MeasurementError as exc:
                    log(f"ERROR: {exc}")
                    failures.append(p.name)
    if failures:
        log(f"ERROR: no figure for: {', '.join(failures)}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C, kill and a closed terminal all raise KeyboardInterrupt, so end in the same clean-up (SIGINT
    # explicitly: a shell starting us in the background leaves it ignored)
    for signum in SIGNALS:
        signal.signal(signum, signal.default_int_handler)
    tmp = Path(tempfile.mkdtemp(prefix="router-queue-bench-"))
    children, code = Children(tmp), 1
    try:
        code = run(args, children, tmp)
    except KeyboardInterrupt:
        log("interrupted; stopping what was started")
        code = 130
    except (RuntimeError, OSError) as exc:  # MeasurementError is a RuntimeError, TimeoutError an OSError
        log(f"ERROR: {exc}")
    except Exception:  # noqa: BLE001 - report, then still clean up
        traceback.print_exc(file=sys.stderr)
    finally:
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        children.stop()
        if args.keep_logs or code != 0:
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
