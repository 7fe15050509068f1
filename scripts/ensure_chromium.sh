#!/bin/sh
# Headless Chromium for the report.html rendering test: installed from Debian packages when missing.
set -e
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = "0" ]; then
    apt-get update && apt-get install -y chromium
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo apt-get update && sudo apt-get install -y chromium
else
    echo "ensure_chromium: chromium is missing and this user cannot install it (run as root:" \
         "apt-get update && apt-get install -y chromium)" >&2
    exit 1
fi
