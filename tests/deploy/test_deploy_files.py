"""The hosted queen's deployment files, checked statically (there is no Docker engine in CI):
the image installs the queen alone and runs it as a non-root user with a health check; the
compose file runs several replicas on one PostgreSQL and one Redis, migrates once before them,
and puts a TLS proxy in front that balances every path, the workers' websockets included, over
healthy replicas; the public URL and forwarded-header settings match the proxy."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from queen_server.settings import QueenSettings
from tests.support.compose import compose_command

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ENV_EXAMPLE = {
    line.split("=", 1)[0]: line.split("=", 1)[1]
    for line in (DEPLOY / ".env.example").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "queen.Dockerfile").read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def run_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The instructions of the last stage (the image that runs)."""
    last = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last:]


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def queens(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: service for name, service in spec["services"].items()
            if name.startswith("queen-")}


def interpolate(value: str) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} against .env.example."""
    def one(match: re.Match[str]) -> str:
        name, op, rest = match.group(1), match.group(2) or "", match.group(3) or ""
        if name in ENV_EXAMPLE and (ENV_EXAMPLE[name] or op != ":-"):
            return ENV_EXAMPLE[name]
        assert op == ":-", f"{name} is required but .env.example does not set it"
        return rest
    return re.sub(r"\$\{([A-Z_][A-Z0-9_]*)(?:(:[-?])([^}]*))?\}", one, value)


def test_the_image_installs_the_queen_alone() -> None:
    instructions = dockerfile_instructions()
    installs = [args for word, args in instructions if word == "RUN" and "pip install" in args]
    assert installs
    assert all('".[queen]"' in args or "'.[queen]'" in args for args in installs)
    everything = " ".join(args for _, args in instructions)
    for extra in (".[dev]", ".[desktop]", ".[worker]", "llama", "pyside", "PySide6"):
        assert extra not in everything
    copied = [args for word, args in instructions if word == "COPY" and "--from" not in args]
    assert not any("desktop_worker" in args or args.startswith(". ") for args in copied)
    assert "**" in (DEPLOY.parent / ".dockerignore").read_text().splitlines()


def test_the_image_runs_as_a_non_root_user_with_a_health_check() -> None:
    final = run_stage(dockerfile_instructions())
    users = [args for word, args in final if word == "USER"]
    assert users
    assert users[-1].split(":")[0] not in {"root", "0"}
    [check] = [args for word, args in final if word == "HEALTHCHECK"]
    assert "/health" in check
    assert "127.0.0.1:8000" in check
    env = " ".join(args for word, args in final if word == "ENV")
    assert "APIARY_HOST=0.0.0.0" in env
    assert "APIARY_PORT=8000" in env
    assert ("EXPOSE", "8000") in final
    [entry] = [args for word, args in final if word == "ENTRYPOINT"]
    assert entry == '["apiary-queen"]'


def test_several_replicas_share_one_postgres_and_one_redis() -> None:
    spec = compose()
    replicas = queens(spec)
    assert len(replicas) >= 2
    databases = {interpolate(s["environment"]["APIARY_DB"]) for s in replicas.values()}
    redises = {interpolate(s["environment"]["APIARY_REDIS_URL"]) for s in replicas.values()}
    assert len(databases) == 1
    assert len(redises) == 1
    [db], [redis] = databases, redises
    assert "@postgres:5432/" in db
    assert "@redis:6379/" in redis
    # Every replica seals the bus with one secret (issue 40), which the operator must set.
    secrets_ = {s["environment"]["APIARY_CLUSTER_SECRET"] for s in replicas.values()}
    assert secrets_ == {"${APIARY_CLUSTER_SECRET:?set APIARY_CLUSTER_SECRET in .env}"}
    # The settings accept them as written, mapped to the async driver, password kept.
    settings = QueenSettings(db=db, redis_url=redis,
                             cluster_secret=interpolate(secrets_.pop()))
    assert settings.db.startswith("postgresql+asyncpg://apiary:")
    assert ENV_EXAMPLE["POSTGRES_PASSWORD"] in settings.db
    ids = [s["environment"]["APIARY_REPLICA_ID"] for s in replicas.values()]
    assert len(set(ids)) == len(ids)
    for name, service in replicas.items():
        assert "ports" not in service, f"{name} must be reached through the proxy only"
        assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["build"]["dockerfile"] == "deploy/queen.Dockerfile"
    assert spec["services"]["postgres"]["healthcheck"]["test"]
    assert spec["services"]["redis"]["healthcheck"]["test"]


def test_migrations_run_once_before_the_replicas() -> None:
    migrate = compose()["services"]["migrate"]
    assert migrate["command"] == ["db", "upgrade"]
    assert migrate["restart"] == "no"
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert migrate["environment"]["APIARY_DB"] == next(
        iter(queens(compose()).values()))["environment"]["APIARY_DB"]


def test_signatures_name_the_public_origin_and_only_the_proxy_is_believed() -> None:
    spec = compose()
    subnet = spec["networks"]["edge"]["ipam"]["config"][0]["subnet"]
    for service in queens(spec).values():
        env = service["environment"]
        assert interpolate(env["APIARY_PUBLIC_URL"]) == f"https://{ENV_EXAMPLE['APIARY_DOMAIN']}"
        assert env["APIARY_FORWARDED_ALLOW_IPS"] == subnet
        assert env["APIARY_ADMIN_COOKIE_SECURE"] == "always"
        assert set(service["networks"]) == {"edge", "backend"}
        settings = QueenSettings(public_url=interpolate(env["APIARY_PUBLIC_URL"]),
                                 forwarded_allow_ips=interpolate(subnet))
        assert settings.public_url == ["https://queen.example.com"]
    assert spec["services"]["caddy"]["networks"] == ["edge"]
    assert spec["services"]["postgres"]["networks"] == ["backend"]
    assert spec["networks"]["backend"]["internal"] is True


def test_the_proxy_terminates_tls_and_balances_every_path_over_healthy_replicas() -> None:
    spec = compose()
    caddy = spec["services"]["caddy"]
    assert {"80:80", "443:443"} <= set(caddy["ports"])
    assert "./Caddyfile:/etc/caddy/Caddyfile:ro" in caddy["volumes"]
    assert any(volume.endswith(":/data") for volume in caddy["volumes"])  # certificates kept
    caddyfile = (DEPLOY / "Caddyfile").read_text()
    code = "\n".join(line.split("#", 1)[0] for line in caddyfile.splitlines())
    assert "{$APIARY_DOMAIN} {" in code  # a site address: automatic HTTPS for the domain
    assert "tls internal" not in code
    assert "auto_https off" not in code
    [upstreams] = re.findall(r"reverse_proxy ([^{\n]*)\{", code)
    assert set(upstreams.split()) == {f"{name}:8000" for name in queens(spec)}
    # No path matcher or handle block: /worker (websockets) and /v1 go the same way.
    assert not re.search(r"^\s*(handle|route|@\w+|respond|redir)\b", code, re.MULTILINE)
    for directive in ("health_uri /health", "lb_policy least_conn", "flush_interval -1"):
        assert directive in code


def test_docker_compose_parses_the_file(tmp_path: Path) -> None:
    compose = compose_command()
    env = tmp_path / ".env"
    env.write_text((DEPLOY / ".env.example").read_text())
    for files in (["compose.yaml"], ["compose.yaml", "compose.offline.yaml"]):
        result = subprocess.run([*compose, "--env-file", str(env),
                                 *(arg for name in files for arg in ("-f", str(DEPLOY / name))),
                                 "config", "-q"],
                                capture_output=True, text=True, check=False, timeout=60)
        assert result.returncode == 0, result.stderr


def test_operators_keep_the_official_images_and_an_offline_build_takes_its_own_base() -> None:
    instructions = dockerfile_instructions()
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in instructions
    froms = [args for word, args in instructions if word == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    spec = compose()
    images = {name: spec["services"][name]["image"] for name in ("postgres", "redis", "caddy")}
    assert images == {"postgres": "postgres:16-bookworm", "redis": "redis:7-bookworm",
                      "caddy": "caddy:2"}
    offline = yaml.safe_load((DEPLOY / "compose.offline.yaml").read_text())["services"]
    assert set(offline) == {"migrate", *queens(spec), "postgres", "redis", "caddy"}
    for service in offline.values():  # everything built on the one base image
        assert service["build"]["args"]["BASE_IMAGE"].startswith("${APIARY_BASE_IMAGE:-")
