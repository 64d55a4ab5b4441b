#!/usr/bin/env bash
# What the image promises, checked before it is saved. The GPU itself is checked at every boot
# of a GPU VM by spotguard-doctor.service; here only when the build VM has one.
set -euo pipefail

# CRIU >= 4.2.1 (older ones cannot dump inet sockets on kernels >= 6.16) and its plugin
v=$(/usr/local/sbin/criu --version | sed -n 's/^Version: *//p')
[ "$(printf '%s\n%s\n' 4.2.1 "$v" | sort -V | head -n1)" = 4.2.1 ] || {
  echo "CRIU $v is older than 4.2.1" >&2
  exit 1
}
test -f /opt/spotguard/criu/lib/criu/plugins/spotguard_nvleftover.so
spotguard --help >/dev/null
systemctl is-enabled spotguard-doctor.service
test -f /etc/tmpfiles.d/spotguard-thp.conf
if [ -e /dev/nvidia0 ]; then
  nvidia-smi
  spotguard doctor
else
  echo "no GPU on the build VM: the driver is checked at boot by spotguard-doctor.service"
fi
