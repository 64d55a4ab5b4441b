#!/usr/bin/env bash
# NVIDIA driver >= 570 (the CUDA checkpoint API: cuCheckpointProcess*); the image defaults to 580,
# the first branch whose restore remaps GPUs (a job restored onto another VM's GPUs). Ubuntu's "server" driver
# packages come with kernel modules signed by Canonical, so they load under secure boot (GCP
# shielded VMs) without enrolling a key.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
: "${NVIDIA_DRIVER_BRANCH:?set NVIDIA_DRIVER_BRANCH (570 or newer)}"

if [ "$NVIDIA_DRIVER_BRANCH" -lt 570 ]; then
  echo "NVIDIA driver branch $NVIDIA_DRIVER_BRANCH has no checkpoint API: need 570 or newer" >&2
  exit 1
fi

branch="${NVIDIA_DRIVER_BRANCH}-server"
apt-get install -y -q --no-install-recommends \
  "linux-modules-nvidia-${branch}-generic" \
  "nvidia-driver-${branch}" \
  "nvidia-utils-${branch}" \
  "libnvidia-compute-${branch}"

# Keep the driver loaded between jobs (faster CUDA start, stable device state for restore).
systemctl enable nvidia-persistenced.service || true

if [ "$NVIDIA_DRIVER_BRANCH" -lt 580 ]; then
  echo "warning: driver branch $NVIDIA_DRIVER_BRANCH restores only onto the same GPUs (remap needs 580+)" >&2
fi

# libcuda must be the r570+ one: the agent calls the checkpoint API through it.
version=$(dpkg-query -W -f='${Version}' "nvidia-utils-${branch}")
major=${version%%.*}
if [ "$major" -lt 570 ]; then
  echo "installed NVIDIA utils $version are older than 570" >&2
  exit 1
fi
echo "NVIDIA driver $version installed"
