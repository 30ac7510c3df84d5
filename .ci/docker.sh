#!/usr/bin/env bash
# Docker for the compose stack test (tests/deploy/test_compose_up.py): Debian's docker.io,
# docker-compose and debootstrap, installed when missing, and a Docker daemon started when none
# answers. Exits 0 when `docker info` works (then .ci/run sets APIARY_TEST_COMPOSE=1), else 1
# with the reason (the test then skips, saying so).
set -uo pipefail
export DEBIAN_FRONTEND=noninteractive
as_root=()
[ "$(id -u)" != 0 ] && as_root=(sudo)
missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
command -v docker-compose > /dev/null || docker compose version > /dev/null 2>&1 \
    || missing+=(docker-compose)
command -v debootstrap > /dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    ("${as_root[@]}" apt-get install -y -q "${missing[@]}" \
        || ("${as_root[@]}" apt-get update -q && "${as_root[@]}" apt-get install -y -q "${missing[@]}")) >&2 \
        || { echo "docker.sh: could not install ${missing[*]}" >&2; exit 1; }
fi
if ! docker info > /dev/null 2>&1; then
    log=$(mktemp /tmp/dockerd.XXXXXX.log)
    "${as_root[@]}" nohup dockerd > "$log" 2>&1 &
    for _ in $(seq 1 60); do
        docker info > /dev/null 2>&1 && break
        sleep 0.5
    done
fi
if ! docker info > /dev/null 2>&1; then
    echo "docker.sh: no Docker daemon could be started here (see ${log:-the dockerd log})" >&2
    tail -5 "${log:-/dev/null}" >&2
    exit 1
fi
echo "docker.sh: $(docker version --format 'Docker {{.Server.Version}}' 2>/dev/null) answers" >&2
