"""``router-queue dev``: the whole stack on one machine, supervised, on an
embedded Redis when none is configured. Never imported by the serving path."""
