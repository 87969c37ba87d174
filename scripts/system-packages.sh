#!/usr/bin/env bash
# Install the system (Debian) packages the test brokers need and the machine image may lack.
# Idempotent: a package whose command is already on PATH is left alone, and apt-get runs only when
# something is missing. Needs root (CI and the development machines run as root); without root it
# says what to install and exits non-zero.
#
# - redis-server (Debian's package `redis-server`, which brings `redis-cli`): the Redis Streams
#   integration and e2e tests start a real one (devkit/redis_broker.py) unless REDIS_URL points at
#   a running server.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "system-packages: missing ${missing[*]}; run as root: apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists of a fresh machine may be empty or stale: refresh them once, only now.
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Debian's package starts a system-wide server on port 6379 where an init system runs; the tests
# start their own on free ports and never use it.
for command_name in "${missing[@]}"; do
  command -v "$command_name" >/dev/null 2>&1 || { echo "system-packages: $command_name still missing" >&2; exit 1; }
done
echo "system-packages: installed ${missing[*]}"
