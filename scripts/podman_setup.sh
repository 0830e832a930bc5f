#!/usr/bin/env bash
# Install and configure rootful podman for the CPU image test on this kind of machine (Debian 12,
# root, no systemd as PID 1, cgroup v1, a TLS-intercepting egress proxy).
#
#   scripts/podman_setup.sh            install what is missing, write the configuration, check it
#
# Writes /etc/containers/containers.conf and /etc/containers/storage.conf, each marked as ours;
# a file without the marker (someone else's configuration) is left alone with a warning.
#   containers.conf  runtime runc; cgroupfs + file events (no systemd here); default ulimits
#                    nofile=20000:20000 nproc=32768:32768 (podman's defaults, a nofile of 1M,
#                    exceed this host's hard limit and every container start fails)
#   storage.conf     driver overlay (kernel overlayfs on the ext4 root); vfs only when a test
#                    mount of overlay fails (override with STORAGE_DRIVER=vfs|overlay)
# Prints the storage driver in use as its last line ("storage-driver: overlay").
set -euo pipefail

MARK="# written by scripts/podman_setup.sh"
CONF_DIR=${CONTAINERS_CONF_DIR:-/etc/containers}
GRAPHROOT=${PODMAN_GRAPHROOT:-/var/lib/containers/storage}
RUNROOT=${PODMAN_RUNROOT:-/run/containers/storage}

log() { echo "podman-setup: $*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  log "must run as root (rootful podman)"
  exit 1
fi

need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  # Without recommends: no crun/fuse-overlayfs/slirp4netns (rootless only); conmon, CNI plugins
  # and iptables come as dependencies.
  apt-get install -y -q --no-install-recommends podman runc
fi

# Kernel overlayfs: try a real mount on the filesystem that will hold the storage.
overlay_works() {
  local parent probe rc=0
  parent=$(dirname "$GRAPHROOT")
  mkdir -p "$parent"
  probe=$(mktemp -d "$parent/.overlay-probe.XXXXXX")
  mkdir -p "$probe"/{lower,upper,work,merged}
  echo probe >"$probe/lower/f"
  if mount -t overlay overlay \
      -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" \
      2>/dev/null; then
    [ "$(cat "$probe/merged/f")" = probe ] || rc=1
    umount "$probe/merged"
  else
    rc=1
  fi
  rm -rf "$probe"
  return "$rc"
}

driver=${STORAGE_DRIVER:-}
if [ -z "$driver" ]; then
  if grep -qw overlay /proc/filesystems && overlay_works; then
    driver=overlay
  else
    driver=vfs
    log "WARNING: kernel overlayfs mount failed on $(dirname "$GRAPHROOT"); falling back to vfs" \
      "(every layer is a full copy: slower builds, several times the disk)"
  fi
fi

# write_conf FILE: replace FILE with stdin unless FILE exists without our marker.
write_conf() {
  local file=$1 tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if [ -e "$file" ] && ! grep -qF "$MARK" "$file"; then
    if cmp -s "$tmp" "$file"; then rm -f "$tmp"; return 0; fi
    log "WARNING: $file exists and is not ours; leaving it (wanted:)"
    sed 's/^/    /' "$tmp" >&2
    rm -f "$tmp"
    return 0
  fi
  if ! cmp -s "$tmp" "$file" 2>/dev/null; then
    install -m 0644 "$tmp" "$file"
    log "wrote $file"
  fi
  rm -f "$tmp"
}

mkdir -p "$CONF_DIR"

# An existing store of another driver cannot be reused by this one: podman refuses to start.
if [ -f "$GRAPHROOT/libpod/bolt_state.db" ] || [ -d "$GRAPHROOT/overlay" ] || [ -d "$GRAPHROOT/vfs" ]; then
  for other in overlay vfs; do
    if [ "$other" != "$driver" ] && [ -d "$GRAPHROOT/$other-images" ]; then
      log "WARNING: $GRAPHROOT holds $other images; with driver $driver podman may refuse them" \
        "(podman system reset, or STORAGE_DRIVER=$other)"
    fi
  done
fi

write_conf "$CONF_DIR/storage.conf" <<EOF
$MARK
[storage]
driver = "$driver"
runroot = "$RUNROOT"
graphroot = "$GRAPHROOT"

[storage.options.overlay]
# Kernel overlayfs; no fuse-overlayfs (rootful podman does not need it).
mountopt = "nodev"
EOF

write_conf "$CONF_DIR/containers.conf" <<EOF
$MARK
[containers]
# podman's default nofile (1048576) exceeds this host's hard limit: container starts fail.
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
# No systemd as PID 1 here: plain cgroupfs, events to a file.
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF

# Smoke check: podman talks to its store with this configuration.
if ! podman info --format '{{.Store.GraphDriverName}} {{.Host.OCIRuntime.Name}}' >/dev/null; then
  log "podman info failed with this configuration"
  exit 1
fi
echo "storage-driver: $(podman info --format '{{.Store.GraphDriverName}}')" \
  "runtime: $(podman info --format '{{.Host.OCIRuntime.Name}}')" \
  "podman: $(podman version --format '{{.Client.Version}}')"
