#!/bin/sh
# Install (or upgrade) spotguard on a VM: its own virtualenv, then `spotguard install`
# (link into /usr/local/bin, systemd units, /etc/spotguard, /var/lib/spotguard, doctor).
#
#   sudo sh install.sh SPEC [EXTRAS]
#   sudo sh packaging/install.sh dist/spotguard-0.1.0-py3-none-any.whl aws,gpu
#   sudo PIP_INDEX_URL=https://pypi.example.internal/simple sh install.sh spotguard gcp,gpu
#
# SPEC: a wheel path (python3 -m pip wheel --no-deps -w dist . in the repository), or a
# requirement served by your own package index (spotguard is not on the public one);
# EXTRAS: aws, gcp, gpu, comma-separated (default: aws,gpu). Environment: SPOTGUARD_VENV (default /opt/spotguard/venv), PYTHON
# (default python3, >= 3.11). Works where pip refuses system installs (Debian 12, Ubuntu 24.04:
# "externally-managed-environment"): nothing is installed outside the virtualenv but the link,
# the units and the directories.
set -eu
say() { echo "install.sh: $*" >&2; }
if [ $# -lt 1 ] || [ -z "$1" ]; then
  say "usage: sudo sh $0 WHEEL|REQUIREMENT [EXTRAS]: spotguard is not on the package index;"
  say "build a wheel first: python3 -m pip wheel --no-deps -w dist . (in the repository)"
  exit 2
fi
SPEC=$1
EXTRAS=${2:-aws,gpu}
VENV=${SPOTGUARD_VENV:-/opt/spotguard/venv}
PYTHON=${PYTHON:-python3}

if [ "$(id -u)" -ne 0 ]; then
  say "run as root: sudo sh $0 $*"
  exit 2
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  say "$PYTHON is missing or older than 3.11: set PYTHON=/path/to/python3.11"
  exit 2
fi
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV" || {
    say "cannot create $VENV (on Debian/Ubuntu: apt-get install python3-venv)"
    exit 1
  }
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --upgrade "${SPEC}[${EXTRAS}]"
exec "$VENV/bin/spotguard" install
