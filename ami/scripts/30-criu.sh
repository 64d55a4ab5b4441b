#!/usr/bin/env bash
# CRIU >= 4.0 through the project's own installer (Debian's criu 4.x unpacked into a private
# prefix with its own loader; the host's libraries are left alone), linked onto PATH.
set -euo pipefail
: "${SPOTGUARD_FILES:?set SPOTGUARD_FILES (the folder the build uploaded the files to)}"

install -m 0755 "$SPOTGUARD_FILES/install-criu" /usr/local/sbin/spotguard-install-criu
criu=$(SPOTGUARD_CRIU_PREFIX=/opt/spotguard/criu /usr/local/sbin/spotguard-install-criu | tail -n 1)
ln -sf "$criu" /usr/local/sbin/criu
/usr/local/sbin/criu --version
