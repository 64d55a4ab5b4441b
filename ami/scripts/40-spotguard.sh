#!/usr/bin/env bash
# spotguard from its wheel into its own virtualenv, the CLI on PATH, the systemd units, the
# config directory and the state directory.
set -euo pipefail
: "${SPOTGUARD_WHEEL:?set SPOTGUARD_WHEEL (path of the uploaded wheel)}"
: "${SPOTGUARD_FILES:?set SPOTGUARD_FILES (the folder the build uploaded the files to)}"

venv=/opt/spotguard/venv
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet "${SPOTGUARD_WHEEL}[aws,gcp,gpu]"
ln -sf "$venv/bin/spotguard" /usr/local/bin/spotguard
spotguard --version

install -d -m 0700 /etc/spotguard /var/lib/spotguard
install -m 0644 "$SPOTGUARD_FILES/spotguard.toml.example" /etc/spotguard/spotguard.toml.example
for unit in spotguard-agent.service spotguard-controller.service spotguard-doctor.service; do
  install -m 0644 "$SPOTGUARD_FILES/$unit" "/etc/systemd/system/$unit"
done
systemctl daemon-reload
# The boot check runs on every boot. The agent is started by the first-boot user-data (or by an
# assignment) once its config exists; the controller is enabled by hand where it runs.
systemctl enable spotguard-doctor.service
