#!/usr/bin/env bash
# Transparent huge pages. With THP=always the driver's device->host copy and CRIU's dump and
# restore ran 1.3-1.5x faster on an H100 VM (fewer page faults on freshly touched host memory);
# madvise leaves the choice to the job. Applied at every boot by systemd-tmpfiles.
set -euo pipefail
: "${THP_MODE:=always}"

case "$THP_MODE" in
  always | madvise | never) ;;
  *)
    echo "THP_MODE must be always, madvise or never, not $THP_MODE" >&2
    exit 1
    ;;
esac

cat >/etc/tmpfiles.d/spotguard-thp.conf <<CONF
# spotguard: transparent huge pages (see ami/scripts/50-tuning.sh)
w /sys/kernel/mm/transparent_hugepage/enabled - - - - ${THP_MODE}
w /sys/kernel/mm/transparent_hugepage/defrag - - - - madvise
CONF

# Checkpoints of large jobs stage tens of GiB in memory: never swap them out.
cat >/etc/sysctl.d/90-spotguard.conf <<'CONF'
vm.swappiness = 0
CONF
