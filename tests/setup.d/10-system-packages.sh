#!/usr/bin/env bash
# Debian packages the real-component tests use: a browser for the dashboard test and
# a Prometheus server (with promtool) for the scrape test.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v ip >/dev/null 2>&1 || need+=(iproute2)  # the two-host tests: network namespaces
[ -e /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 ] || need+=(libfaketime)  # a host whose clock is off
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    else
        echo "not root: cannot install ${need[*]}; tests that need them will skip" >&2
    fi
fi
