#!/usr/bin/env bash
# Makes sure Debian's Chromium and its matching WebDriver exist, for the web view's browser tests
# (tests/integration/test_ui_browser.py) and `make bench`'s view figures. Installed by apt, never
# downloaded by a test tool (this machine reaches no browser CDN). Not root, or no apt: says why
# and exits 0; the browser tests then fail with that reason.
# Usage: install_browser.sh. Idempotent and quiet.
set -euo pipefail

command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: cannot install chromium and chromium-driver (need root and apt-get);" \
    "install them by hand for the browser tests" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -qq chromium chromium-driver >/dev/null 2>&1; then
  apt-get update -qq
  apt-get install -y -qq chromium chromium-driver >/dev/null
fi
