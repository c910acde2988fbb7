#!/usr/bin/env bash
# Prometheus and promtool for tests/deploy/test_monitoring.py (the alert rules checked and unit
# tested, the dashboard's queries and the alerts run against a real server). Does nothing when
# both are on PATH; else installs Debian's package (as root, with apt), else says what to do.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  start=$(date +%s)
  echo "install_prometheus: installing Debian's prometheus (apt)"
  export DEBIAN_FRONTEND=noninteractive
  # Its own daemon is not wanted: the tests start their own servers.
  apt-get install -y -q --no-install-recommends prometheus >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
      prometheus >/dev/null; }
  echo "install_prometheus: done in $(( $(date +%s) - start )) s"
  exit 0
fi
echo "install_prometheus: prometheus and promtool not found. Install them (Debian/Ubuntu:" \
  "apt-get install prometheus, or Prometheus' release archive) so both are on PATH." >&2
exit 1
