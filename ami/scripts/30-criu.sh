#!/usr/bin/env bash
# CRIU >= 4.2.1 through the project's own installer (Debian forky's criu unpacked into a private
# prefix with its own loader; the host's libraries are left alone), linked onto PATH, and
# spotguard's CRIU plugin (leftover /dev/nvidia* references of forked workers) built beside it.
# The prefix keeps its .debs (/opt/spotguard/criu/debs) for hosts that cannot reach Debian.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
: "${SPOTGUARD_FILES:?set SPOTGUARD_FILES (the folder the build uploaded the files to)}"

# a compiler for the plugin (a few KB of C against criu-plugin.h from the same CRIU release)
apt-get install -y -q --no-install-recommends gcc libc6-dev

install -m 0755 "$SPOTGUARD_FILES/install-criu" /usr/local/sbin/spotguard-install-criu
install -d -m 0755 /usr/local/share/spotguard
install -m 0644 "$SPOTGUARD_FILES/spotguard_nvleftover.c" /usr/local/share/spotguard/spotguard_nvleftover.c
criu=$(SPOTGUARD_CRIU_PREFIX=/opt/spotguard/criu \
  SPOTGUARD_CRIU_PLUGIN_SRC=/usr/local/share/spotguard/spotguard_nvleftover.c \
  /usr/local/sbin/spotguard-install-criu | tail -n 1)
ln -sf "$criu" /usr/local/sbin/criu
/usr/local/sbin/criu --version
test -f /opt/spotguard/criu/lib/criu/plugins/spotguard_nvleftover.so
