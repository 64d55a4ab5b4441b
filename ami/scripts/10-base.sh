#!/usr/bin/env bash
# Base packages: what the driver build, CRIU's installer and spotguard need.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive

apt-get update -q
apt-get upgrade -y -q
apt-get install -y -q --no-install-recommends \
  ca-certificates curl jq zstd \
  python3 python3-venv python3-pip \
  debian-archive-keyring \
  linux-headers-generic
