#!/usr/bin/env bash
# Headless Chromium for the `packline ui` browser test (tests/e2e/test_compare_ui.py).
#
# Debian's `chromium` package is a real browser build; Ubuntu's `chromium`/`chromium-browser`
# are stubs that install a snap, which does not run in a container or CI job, so on Ubuntu
# this script refuses instead of installing a stub. Idempotent: nothing to do when a real
# Chromium is already on PATH. Needs root (or sudo) for apt-get.
set -euo pipefail

have_real_chromium() {
    local bin
    for bin in chromium chromium-browser; do
        if command -v "$bin" >/dev/null 2>&1 && "$bin" --version 2>/dev/null | grep -qi chromium; then
            case "$(readlink -f "$(command -v "$bin")")" in
                /snap/*) ;;  # a snap wrapper: not usable headless in CI
                *) echo "$(command -v "$bin"): $("$bin" --version)"; return 0 ;;
            esac
        fi
    done
    return 1
}

if have_real_chromium; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-chromium: needs root (or passwordless sudo) for apt-get" >&2
        exit 1
    fi
fi

. /etc/os-release
if [ "${ID:-}" = "ubuntu" ]; then
    echo "install-chromium: Ubuntu's chromium package is a snap stub; install a real" \
        "Chromium (or Google Chrome) deb by hand and put it on PATH as 'chromium'" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# fonts-dejavu-core: text in screenshots; --no-install-recommends keeps it to the browser.
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
have_real_chromium
