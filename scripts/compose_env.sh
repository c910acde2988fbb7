#!/usr/bin/env bash
# Everything `make compose-test` needs on a Debian machine without an image registry, installed
# or started only where missing (so a second run costs seconds):
#   - the Docker engine (Debian's docker.io; dockerd started in the background when no systemd
#     runs it), the compose v2 plugin (a static binary inside the docker-compose package of
#     Debian's next release, trixie), debootstrap;
#   - local images made from Debian bookworm with debootstrap (no registry needed): one root
#     filesystem with Python 3.11, Redis and Prometheus, imported three times with their own
#     command; the image names are printed as KEY=value lines for compose's interpolation;
#   - deploy/wheelhouse/: wheels of the gateway and its dependencies built on this host, which
#     the Dockerfile installs offline (builds here cannot reach PyPI from inside a container).
#
# Elsewhere (a registry at hand) none of this is needed: `docker compose --profile sim up`
# pulls python:3.11-slim, redis and prom/prometheus as usual.
#
# Usage: scripts/compose_env.sh [ENV_FILE]   (writes the KEY=value lines there too)
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${LLM_GATEWAY_CACHE:-/var/cache/llm-gateway}"
SUITE=bookworm
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_TAG="llm-gateway-local/debian:$SUITE"
PY="${PYTHON_BIN:-.venv/bin/python}"
start=$(date +%s)
say() { echo "compose_env: $* ($(( $(date +%s) - start )) s)"; }
sudo_if() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" \
    >"$CACHE/apt.log" 2>&1 || { cat "$CACHE/apt.log"; exit 1; }
}

sudo_if mkdir -p "$CACHE"

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]}"
  sudo_if apt-get update -q >/dev/null
  apt_install "${missing[@]}"
fi

# The compose v2 plugin: bookworm's docker-compose is v1 (Python); trixie's ships v2 as a static
# binary. apt fetches only that package, with its own lists, leaving the system's sources alone.
if ! docker compose version >/dev/null 2>&1; then
  plugins=/usr/local/lib/docker/cli-plugins
  aptx="$CACHE/trixie-apt"
  opts=(-o "Dir::Etc::SourceList=$aptx/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o "Dir::State::Lists=$aptx/lists" -o "Dir::Cache=$aptx/cache" -o APT::Sandbox::User=root)
  sudo_if mkdir -p "$aptx/lists/partial" "$aptx/cache/archives/partial" "$plugins"
  echo "deb $MIRROR trixie main" | sudo_if tee "$aptx/sources.list" >/dev/null
  say "fetching the compose plugin (trixie's docker-compose package)"
  sudo_if apt-get -q "${opts[@]}" update >/dev/null
  (cd "$aptx" && sudo_if apt-get -q "${opts[@]}" download docker-compose >/dev/null)
  deb=$(ls -t "$aptx"/docker-compose_*.deb | head -n 1)
  rm -rf "$aptx/x" && sudo_if dpkg-deb -x "$deb" "$aptx/x"
  sudo_if install -m 0755 "$aptx/x/usr/libexec/docker/cli-plugins/docker-compose" "$plugins/"
fi

# The engine: started here when nothing else (systemd) runs it.
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd"
  sudo_if sh -c "nohup dockerd >>'$CACHE/dockerd.log' 2>&1 &"
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -n 30 "$CACHE/dockerd.log"; exit 1; }
fi

# The local images: one debootstrap root filesystem, imported under three names.
image() { docker image inspect "$1" >/dev/null 2>&1; }
if ! image "$BASE_TAG"; then
  rootfs="$CACHE/rootfs-$SUITE"
  sudo_if rm -rf "$rootfs"
  say "debootstrap $SUITE (python3, redis, prometheus) into $rootfs"
  sudo_if debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates,redis-server,prometheus,wget \
    "$SUITE" "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -n 30 "$CACHE/debootstrap.log"; exit 1; }
  sudo_if rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  sudo_if mkdir -p "$rootfs/prometheus"
  sudo_if tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$BASE_TAG" >/dev/null
  sudo_if rm -rf "$rootfs"
fi
# The same layer under the names compose uses, each with its own command (a FROM-only build
# adds no layer).
derive() {
  image "$1" || printf 'FROM %s\n%s\n' "$BASE_TAG" "$2" | docker build -q -t "$1" - >/dev/null 2>&1
}
derive "llm-gateway-local/python:$SUITE" 'CMD ["python3"]'
derive "llm-gateway-local/redis:$SUITE" 'CMD ["redis-server"]'
derive "llm-gateway-local/prometheus:$SUITE" 'WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml"]'

# Wheels for the offline install in the Dockerfile: the gateway's own, every dependency's and
# the build backend's. Only the gateway's wheel changes between runs; the rest is reused.
# async-timeout: redis needs it on Python before 3.11.3 (bookworm has 3.11.2; this host may not).
wheelhouse=deploy/wheelhouse
rm -f "$wheelhouse"/llm_gateway-*.whl
say "wheels into $wheelhouse"
"$PY" -m pip wheel -q --wheel-dir "$wheelhouse" . setuptools wheel async-timeout \
  >"$CACHE/wheels.log" 2>&1 \
  || { tail -n 30 "$CACHE/wheels.log"; exit 1; }

vars="PYTHON_IMAGE=llm-gateway-local/python:$SUITE
REDIS_IMAGE=llm-gateway-local/redis:$SUITE
PROMETHEUS_IMAGE=llm-gateway-local/prometheus:$SUITE"
if [ -n "${1:-}" ]; then echo "$vars" >"$1"; fi
echo "$vars"
say "ready: docker $(docker version -f '{{.Server.Version}}'), $(docker compose version --short)"
