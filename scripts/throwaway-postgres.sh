# Sourced by scripts/test and scripts/bench: a throwaway PostgreSQL cluster
# under /tmp on a free loopback port, stopped and removed on exit. Stock
# settings (fsync and synchronous_commit on: every commit is durable) but
# for enough connections for 128 clients and the service. Installs Debian's
# postgresql if it is missing; initdb refuses to run as root, so the
# cluster runs as `postgres` then.
#
#   start_throwaway_postgres VAR   # exports VAR=postgres://postgres@127.0.0.1:PORT/postgres

start_throwaway_postgres() {
    local var=$1
    if [[ -n "${!var:-}" ]]; then
        return
    fi
    local bin
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    if [[ -z "$bin" || ! -x "$bin/initdb" ]]; then
        echo "== installing postgresql"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
    fi
    local as=()
    if [[ $(id -u) -eq 0 ]]; then
        as=(runuser -u postgres --)
    fi
    PG_DIR=$(mktemp -d /tmp/reservoir-pg.XXXXXX)
    chmod 755 "$PG_DIR"
    if [[ $(id -u) -eq 0 ]]; then
        chown postgres "$PG_DIR"
    fi
    local port
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "${as[@]}" "$bin/initdb" -D "$PG_DIR/data" -U postgres --auth=trust >"$PG_DIR/initdb.log"
    "${as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w \
        -o "-c listen_addresses=127.0.0.1 -c port=$port -c unix_socket_directories=$PG_DIR -c max_connections=200" \
        start >/dev/null
    PG_CTL=("${as[@]}" "$bin/pg_ctl" -D "$PG_DIR/data")
    trap stop_throwaway_postgres EXIT
    export "$var=postgres://postgres@127.0.0.1:$port/postgres"
    echo "== postgresql on 127.0.0.1:$port ($PG_DIR)"
}

stop_throwaway_postgres() {
    "${PG_CTL[@]}" -m fast stop >/dev/null || true
    rm -rf "$PG_DIR"
}
