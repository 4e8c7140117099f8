#!/usr/bin/env bash
# Runs a Procfile process by name (web, worker, webhooks, beat), so the image and the
# Procfile can never disagree about a command line; anything else is executed
# as given (python -m stub_provider ..., celery ... flower, bash).
#
# The Procfile's ${VAR:-default} expansions are evaluated here, and `exec`
# makes gunicorn or celery PID 1, so SIGTERM from Docker or Kubernetes reaches
# it directly (gunicorn: graceful stop; celery: warm shutdown).
#
# ENTRYPOINT_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail

PROCFILE=${PROCFILE:-/app/Procfile}

if [ "$#" -eq 0 ]; then
  set -- web
fi

if [ "$#" -eq 1 ] && [ -f "$PROCFILE" ]; then
  line=$(grep -E "^$1:" "$PROCFILE" || true)
  if [ -n "$line" ]; then
    # Word-split and expand the Procfile command as a shell would, then run it.
    eval "set -- ${line#*:}"
  fi
fi

if [ "${ENTRYPOINT_DRY_RUN:-}" = 1 ]; then
  printf '%s\n' "$*"
  exit 0
fi
exec "$@"
