"""Front-door benchmark for router-queue: ``bench/run`` (see bench/README.md)."""
