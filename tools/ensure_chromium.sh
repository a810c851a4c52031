#!/usr/bin/env bash
# A Chromium on PATH for `make test-browser`: Debian's `chromium` package through apt-get when
# none is there (root, or passwordless sudo). Bounded: apt gets 15 minutes at most.
set -euo pipefail
for b in ${COURSE_CHROMIUM:-} chromium chromium-browser google-chrome google-chrome-stable; do
  if command -v "$b" >/dev/null 2>&1; then exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "make test-browser: no Chromium on PATH and no apt-get here; install Chromium or set COURSE_CHROMIUM=/path/to/it" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "make test-browser: no Chromium on PATH; run 'sudo apt-get install chromium' (or set COURSE_CHROMIUM)" >&2
    exit 1
  fi
fi
echo "make test-browser: installing Debian's chromium with apt-get"
timeout 300 $SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive timeout 600 $SUDO apt-get install -y -qq chromium >/dev/null
command -v chromium >/dev/null
