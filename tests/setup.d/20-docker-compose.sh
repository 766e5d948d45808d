#!/usr/bin/env bash
# Debian's docker-compose (1.29, Python) for the static compose test: `docker-compose config`
# validates docker/compose.yaml (+ the CUDA override) against the Compose schema and
# resolves paths without any Docker engine. No engine is installed or needed.
set -euo pipefail
command -v docker-compose >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose >/dev/null
else
    echo "not root: cannot install docker-compose; the compose schema test will skip" >&2
fi
