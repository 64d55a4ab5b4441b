#!/usr/bin/env bash
# Leave no build-time state in the image: package caches, cloud-init's per-instance state, the
# machine id and SSH host keys are made fresh by each VM started from it.
set -euo pipefail

apt-get clean
rm -rf /var/lib/apt/lists/* /tmp/spotguard
cloud-init clean --logs || true
truncate -s 0 /etc/machine-id
rm -f /etc/ssh/ssh_host_*
