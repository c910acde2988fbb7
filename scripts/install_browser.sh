#!/usr/bin/env bash
# Chromium for the console's browser tests (tests/gateway/admin/console), driven by Playwright.
# Does nothing when a Chromium is already there (on PATH, or named by LLM_GATEWAY_CHROMIUM);
# else installs Debian's package (as root, with apt), else says what to do.
set -euo pipefail
if [[ -n "${LLM_GATEWAY_CHROMIUM:-}" && -x "${LLM_GATEWAY_CHROMIUM}" ]] \
  || command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  exit 0
fi
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
  start=$(date +%s)
  echo "install_browser: installing Debian's chromium (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends \
      chromium fonts-dejavu-core >/dev/null; }
  echo "install_browser: done in $(( $(date +%s) - start )) s"
  exit 0
fi
echo "install_browser: no Chromium found. Install one (Debian/Ubuntu: apt-get install chromium)" \
  "or set LLM_GATEWAY_CHROMIUM=/path/to/chromium; the console's browser tests need it." >&2
exit 1
