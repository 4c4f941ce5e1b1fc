#!/usr/bin/env bash
# A Docker engine for `make compose-check`, when this machine runs none.
#
#   docker/engine.sh start   prints the environment to reach an engine (DOCKER_HOST=..., DOCKER_CONFIG=...):
#                            a running one with Compose v2 if there is one, else one it starts
#   docker/engine.sh stop    stops the engine `start` started (nothing else)
#
# The engine it starts is Debian trixie's docker.io / docker-cli / docker-compose (Engine 26, Compose 2.26:
# bookworm's 20.10 cannot run docker-compose.yml), unpacked under $SPECSPLIT_ENGINE_DIR, over bookworm's
# containerd, runc and iptables (installed with apt). `start` exits 3 with one line saying why when it cannot.
set -uo pipefail

DIR=${SPECSPLIT_ENGINE_DIR:-/var/tmp/specsplit-engine}
SOCK=$DIR/docker.sock
TRIXIE="deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main"
MIN_ENGINE=25
MIN_COMPOSE=2.20

fail() { echo "no Docker engine: $*" >&2; exit 3; }

version_ge() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

usable() {  # the engine and Compose that `docker` reaches now are new enough
  local engine compose
  engine=$(docker version --format '{{.Server.Version}}' 2>/dev/null) || return 1
  compose=$(docker compose version --short 2>/dev/null) || return 1
  version_ge "${engine%%+*}" "$MIN_ENGINE" && version_ge "${compose#v}" "$MIN_COMPOSE"
}

start() {
  if command -v docker >/dev/null && usable; then
    echo "DOCKER_HOST=${DOCKER_HOST:-unix:///var/run/docker.sock}"
    [ -n "${DOCKER_CONFIG:-}" ] && echo "DOCKER_CONFIG=$DOCKER_CONFIG"
    return 0
  fi
  [ "$(id -u)" = 0 ] || fail "none is running, and starting one needs root"
  mkdir -p "$DIR"/{pkg,bin,config/cli-plugins,data,exec,lists} || fail "cannot write $DIR"
  if ! [ -x "$DIR/pkg/usr/sbin/dockerd" ]; then
    apt-get install -y -q --no-install-recommends iptables runc containerd debootstrap >"$DIR/apt.log" 2>&1 \
      || fail "apt-get cannot install iptables, runc, containerd, debootstrap (see $DIR/apt.log)"
    echo "$TRIXIE" >"$DIR/trixie.list"
    local o="-o Dir::Etc::SourceList=$DIR/trixie.list -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists=$DIR/lists"
    # shellcheck disable=SC2086
    (cd "$DIR" && apt-get $o update -q && apt-get $o download docker.io docker-cli docker-compose) >>"$DIR/apt.log" 2>&1 \
      || fail "cannot fetch Debian trixie's docker.io, docker-cli, docker-compose (see $DIR/apt.log)"
    for deb in "$DIR"/*.deb; do dpkg -x "$deb" "$DIR/pkg" || fail "cannot unpack $deb"; done
  fi
  ln -sf "$DIR/pkg/usr/bin/docker" "$DIR/bin/docker"
  ln -sf "$DIR/pkg/usr/sbin/dockerd" "$DIR/bin/dockerd"
  ln -sf "$DIR/pkg/usr/sbin/docker-proxy" "$DIR/bin/docker-proxy"
  ln -sf "$DIR/pkg/usr/libexec/docker/cli-plugins/docker-compose" "$DIR/config/cli-plugins/docker-compose"
  for t in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
    [ -x "/usr/sbin/${t/tables/tables-legacy}" ] && ln -sf "/usr/sbin/${t/tables/tables-legacy}" "$DIR/bin/$t"
  done
  export PATH="$DIR/bin:$PATH" DOCKER_HOST="unix://$SOCK" DOCKER_CONFIG="$DIR/config"
  if ! usable; then
    setsid dockerd --data-root "$DIR/data" --exec-root "$DIR/exec" --pidfile "$DIR/dockerd.pid" -H "$DOCKER_HOST" \
      --storage-driver overlay2 >"$DIR/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 60); do usable && break; sleep 0.5; done
    usable || fail "dockerd did not start: $(grep -m1 -iE 'failed|error' "$DIR/dockerd.log" | cut -c1-200)"
    touch "$DIR/started-here"
  fi
  echo "DOCKER_HOST=$DOCKER_HOST"
  echo "DOCKER_CONFIG=$DOCKER_CONFIG"
  echo "PATH=$PATH"
}

stop() {
  [ -f "$DIR/started-here" ] || return 0
  if [ -f "$DIR/dockerd.pid" ]; then
    kill "$(cat "$DIR/dockerd.pid")" 2>/dev/null
    for _ in $(seq 40); do [ -f "$DIR/dockerd.pid" ] || break; sleep 0.5; done
  fi
  rm -f "$DIR/started-here"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
