#!/usr/bin/env bash
# Start a throwaway PostgreSQL (Debian's package) on a free port under /tmp and print the URL
# the billing tests read from APIARY_TEST_POSTGRES_URL. Installs the package if it is missing.
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    (apt-get install -y -q postgresql || (apt-get update -q && apt-get install -y -q postgresql)) >&2
fi
bin=$(dirname "$(ls /usr/lib/postgresql/*/bin/initdb | sort -V | tail -n 1)")
data=$(mktemp -d /tmp/apiary-pg.XXXXXX)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_pg=()
if [ "$(id -u)" = 0 ]; then
    chown postgres "$data"
    as_pg=(runuser -u postgres --)
fi
"${as_pg[@]}" "$bin/initdb" -D "$data/db" -U postgres --auth=trust >&2
"${as_pg[@]}" "$bin/pg_ctl" -D "$data/db" -l "$data/log" -w \
    -o "-p $port -k $data -c listen_addresses=127.0.0.1 -c fsync=off" start >&2
echo "postgresql+asyncpg://postgres@127.0.0.1:$port/postgres"
