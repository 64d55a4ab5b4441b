#!/usr/bin/env bash
# What the image promises, checked before it is saved. The GPU itself is checked at every boot
# of a GPU VM by spotguard-doctor.service; here only when the build VM has one.
set -euo pipefail

/usr/local/sbin/criu --version | grep -Eq '^Version: ([4-9]|[1-9][0-9])\.'
spotguard --help >/dev/null
systemctl is-enabled spotguard-doctor.service
test -f /etc/tmpfiles.d/spotguard-thp.conf
if [ -e /dev/nvidia0 ]; then
  nvidia-smi
  spotguard doctor
else
  echo "no GPU on the build VM: the driver is checked at boot by spotguard-doctor.service"
fi
