#!/usr/bin/env bash
# Make the stand-in of the platform's base image (PLATFORM.md; the vendor image is not reachable
# here) with debootstrap + podman import, unless an image of that name built from the same inputs
# already exists (the key below is stored as a label; no registry is reachable, nothing to pull).
#
#   scripts/make_base_image.sh [IMAGE]      default localhost/standin-corex-base:0.6.3
#
# What it mirrors of the vendor's image (bi100-3.2.3-x86-ubuntu20.04-py3.10-poc-llm-infer):
#   Python 3.10 installed at /usr/local (python3 = /usr/local/bin/python3): the host's pyenv
#     build (PY310_HOME), which is built on Debian 12, so the rootfs is Debian 12 (bookworm)
#     minbase with the shared libraries its extension modules link (ldd-checked below);
#   torch, vLLM (and torch's nvidia-* libraries) in /usr/local/corex/lib64/python3/dist-packages,
#     every other package (transformers 4.51.3, fastapi, ...) in
#     /usr/local/lib/python3.10/site-packages: the packages of the stand-in venv
#     (scripts/standin_v0/build_env.sh: torch 2.1.2, vLLM 0.6.3's Python layer as 0.6.3+cpu);
#   gcc/g++ (the vendor's image has gcc and cmake); no ninja, no CoreX clang, no GPU.
# What it leaves to the Dockerfile: the CoreX environment (PATH, PYTHONPATH, LD_LIBRARY_PATH).
# The base does not set PYTHONPATH, so `import torch` fails in a build that forgets it -- on the
# vendor's image teams set it themselves.
#
# Two tiers, so that the stand-in's own small packages (the folders of scripts/standin_v0 with an
# __init__.py: vllm_standin, pyairports), which change often, cost seconds and not a rebuild:
#   IMAGE-packages  (e.g. localhost/standin-corex-base:0.6.3-packages) debootstrap + Python +
#                   the venv's packages; keyed on this script, the other files of
#                   scripts/standin_v0 (build_env.sh, requirements.txt, repack_vllm.py), the Debian
#                   packages and the Python version; rebuilt only when one of those changes
#   IMAGE           FROM it, the stand-in's package folders copied over site-packages
#                   (podman build --network=none); keyed on the packages tier's key + those folders
#
# Slimming (the stand-in's image only; SLIM=0 keeps everything): cuDNN's six sub-libraries
# (1.2 GB) go. libcudnn.so.8 opens them on the first cuDNN call, which a CPU never makes;
# `import torch, vllm` and a matmul are checked in the finished image.
#
# Environment: FORCE=1 rebuilds; PRINT_KEYS=1 prints the two keys and stops; MIRROR (Debian
# mirror); PY310_HOME (/root/.pyenv/versions/3.10.13); STANDIN_VENV (build/standin-base/venv:
# a venv of its own, so a shared .venv-v0 with an overlay deployed in it never leaks into the base).
set -euo pipefail

# Everything runs inside main, which bash reads whole before running: editing this file during a
# run cannot change what the run does.
main() {
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

IMAGE=${1:-localhost/standin-corex-base:0.6.3}
SUITE=bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PY310_HOME=${PY310_HOME:-$(ls -d /root/.pyenv/versions/3.10.* 2>/dev/null | tail -n 1)}
VENV=${STANDIN_VENV:-build/standin-base/venv}
SLIM=${SLIM:-1}
# Shared libraries of the copied Python's extension modules (_ssl, _ctypes, _sqlite3, _bz2, _lzma,
# zlib, readline, _curses, _uuid, nis, pyexpat) + CA certificates + gcc/g++ as on the vendor's.
PACKAGES="ca-certificates,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libreadline8"
PACKAGES+=",libncursesw6,libuuid1,libnsl2,libexpat1,gcc,g++"
COREX_SITE=/usr/local/corex/lib64/python3/dist-packages
SITE=/usr/local/lib/python3.10/site-packages

log() { echo "base-image: $*" >&2; }

[ -x "$PY310_HOME/bin/python3.10" ] || { log "no Python 3.10 at PY310_HOME=$PY310_HOME"; exit 1; }
pyver=$("$PY310_HOME/bin/python3.10" -c 'import platform; print(platform.python_version())')
# The stand-in's scripts are read from a snapshot: someone editing them meanwhile can neither
# break this run nor leave an image labelled with a key it was not built from.
snap=$(mktemp -d /var/tmp/standin-scripts.XXXXXX)
work=""  # the packages tier's rootfs, while it is built
mounts_under() { findmnt -rn -o TARGET | grep -E "^$1/" | sort -r || true; }
cleanup() {
  # debootstrap mounts proc/sys inside the chroot and may leave them on failure: unmount
  # before deleting, and never delete through a mount that stays.
  local m
  [ -n "$work" ] || return 0
  for m in $(mounts_under "$work"); do umount -l "$m" || true; done
  if [ -n "$(mounts_under "$work")" ]; then
    log "WARNING: mounts remain under $work; not deleting it"
    return 0
  fi
  rm -rf "$work"
  work=""
}
trap 'cleanup; rm -rf "$snap"' EXIT
cp -r scripts/standin_v0 "$snap/"
find "$snap" -name __pycache__ -prune -exec rm -rf {} +
# The stand-in's Python packages (copied into site-packages by build_env.sh and by the top tier).
pkgs=()
for d in "$snap"/standin_v0/*/; do
  if [ -f "$d/__init__.py" ]; then pkgs+=("$(basename "$d")"); fi
done
hash_files() {  # hash_files FIND-ARGS...: names and contents of the snapshot's files
  (cd "$snap" && find standin_v0 -type f "$@" | LC_ALL=C sort |
    while IFS= read -r f; do echo "$f"; cat "$f"; done)
}
not_pkgs=()
for p in "${pkgs[@]}"; do not_pkgs+=(! -path "standin_v0/$p/*"); done
only_pkgs=(-false)
for p in "${pkgs[@]}"; do only_pkgs+=(-o -path "standin_v0/$p/*"); done
build_heavy() {
# The packages: the stand-in venv (a no-op when its own key is current).
VENV_V0=$VENV bash "$snap/standin_v0/build_env.sh" >&2
venv_site=$VENV/lib/python3.10/site-packages
[ -d "$venv_site/vllm" ] && [ -d "$venv_site/torch" ] || { log "$venv_site lacks vllm/torch"; exit 1; }
venv_s=$(( $(date +%s) - start ))

if ! command -v debootstrap >/dev/null 2>&1; then
  log "installing debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q --no-install-recommends debootstrap
fi

work=$(mktemp -d /var/tmp/standin-base.XXXXXX)

t=$(date +%s)
log "debootstrap $SUITE ($MIRROR) with $PACKAGES"
root=$work/rootfs
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" \
  >"$work/debootstrap.log" 2>&1 || {
  tail -40 "$work/debootstrap.log" >&2
  tail -40 "$root/debootstrap/debootstrap.log" >&2 2>/dev/null || true
  log "debootstrap failed"
  exit 1
}
boot_s=$(( $(date +%s) - t ))
cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF

# --- Python 3.10 at /usr/local ----------------------------------------------------------------
# Its standard library and pip/setuptools only: whatever else the host's pyenv site-packages
# holds is the host's, not the base's.
t=$(date +%s)
for d in bin include lib share; do
  [ -d "$PY310_HOME/$d" ] || continue
  mkdir -p "$root/usr/local/$d"
  tar -C "$PY310_HOME/$d" --exclude=./python3.10/site-packages --exclude=./python3.10/test \
    --exclude='__pycache__' -cf - . | tar -C "$root/usr/local/$d" -xf -
done
mkdir -p "$root$SITE"
for f in "$PY310_HOME"/lib/python3.10/site-packages/{pip,pip-*.dist-info,setuptools,setuptools-*.dist-info,_distutils_hack,pkg_resources,distutils-precedence.pth}; do
  [ -e "$f" ] && cp -a "$f" "$root$SITE/"
done
# The build prefix is written into scripts' shebangs and the sysconfig data; it is /usr/local now.
grep -rlI --null -F "$PY310_HOME" "$root/usr/local/bin" "$root/usr/local/lib/python3.10" \
  "$root/usr/local/lib/pkgconfig" 2>/dev/null | xargs -0 -r sed -i "s|$PY310_HOME|/usr/local|g"
chroot "$root" /sbin/ldconfig
# Every extension module of the standard library finds its libraries in the rootfs.
missing=$(chroot "$root" /bin/sh -c 'for f in /usr/local/bin/python3.10 \
  /usr/local/lib/python3.10/lib-dynload/*.so; do ldd "$f"; done' | grep 'not found' |
  grep -v -E 'libtk|libtcl|libX' | sort -u || true)  # tkinter: not part of a server image
if [ -n "$missing" ]; then
  log "shared libraries missing in the rootfs: $missing"
  exit 1
fi
rm -f "$root/usr/local/lib/python3.10/lib-dynload/_tkinter"*.so

# --- the packages at the vendor's paths -----------------------------------------------------------
mkdir -p "$root$COREX_SITE" "$root/usr/local/corex/lib/python3/dist-packages"
shopt -s nullglob dotglob
for entry in "$venv_site"/*; do
  name=$(basename "$entry")
  case $name in
    pip|pip-*.dist-info|setuptools|setuptools-*.dist-info|_distutils_hack|pkg_resources|\
    distutils-precedence.pth|__pycache__) continue ;;  # the base Python's own
    torch|torch-*.dist-info|torchgen|functorch|nvidia|nvidia_*_cu12-*.dist-info|vllm|\
    vllm-*.dist-info) dest=$COREX_SITE ;;  # the vendor's corex tree (torch finds nvidia/ beside it)
    *) dest=$SITE ;;
  esac
  cp -a "$entry" "$root$dest/"
done
shopt -u nullglob dotglob
if [ "$SLIM" = 1 ]; then
  rm -f "$root$COREX_SITE"/nvidia/cudnn/lib/libcudnn_{adv,cnn,ops}_{infer,train}.so.8
fi
find "$root/usr/local" -name __pycache__ -prune -exec rm -rf {} +
copy_s=$(( $(date +%s) - t ))

# Keep the image small: package caches and lists go (apt-get update restores the lists).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
  "$root"/tmp/* "$root"/var/tmp/*
if [ -n "$(mounts_under "$root")" ]; then
  log "mounts remain under $root after debootstrap: $(mounts_under "$root" | tr '\n' ' ')"
  exit 1
fi

t=$(date +%s)
tar -C "$root" --numeric-owner -cf - . | podman import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --change "LABEL org.local.base.key=\"$heavy_key\"" \
  --change "LABEL org.local.base.python=\"$pyver\"" \
  --quiet - "$HEAVY" >/dev/null
import_s=$(( $(date +%s) - t ))
# Deleting the 4 GB rootfs took minutes on a busy disk: it goes in the background (a fresh
# mktemp name each run, so nothing waits for it).
nohup nice -n 19 rm -rf "$work" >/dev/null 2>&1 &
work=""
}

# The top tier: the stand-in's own packages, current.
build_top() {
t=$(date +%s)
top=$snap/top
mkdir -p "$top"
{
  echo "FROM $HEAVY"
  # the packages tier's copies (build_env.sh's of its day) go; the snapshot's come in
  echo "RUN rm -rf ${pkgs[*]/#/$SITE/}"
  for p in "${pkgs[@]}"; do
    cp -r "$snap/standin_v0/$p" "$top/"
    echo "COPY $p/ $SITE/$p/"
  done
  echo "LABEL org.local.base.key=\"$key\""
} >"$top/Containerfile"
podman build --pull=never --network=none --quiet -t "$IMAGE" -f "$top/Containerfile" "$top" >/dev/null
top_s=$(( $(date +%s) - t ))
}

# The packages tier's key: everything that decides its content -- the recipe above as bash
# prints it (comments and layout do not count), the other files of the stand-in's folder, the
# paths, Debian packages and Python version.
heavy_key=$( { declare -f build_heavy; hash_files "${not_pkgs[@]}"
               echo "$SUITE $PACKAGES $COREX_SITE $SITE python $pyver slim $SLIM"; } |
             sha256sum | cut -c1-16)
key=$( { echo "$heavy_key"; declare -f build_top; hash_files \( "${only_pkgs[@]}" \); } |
       sha256sum | cut -c1-16)
HEAVY=$IMAGE-packages
if [ "${PRINT_KEYS:-0}" = 1 ]; then echo "packages_key=$heavy_key key=$key"; exit 0; fi
label() { podman image inspect --format "{{index .Labels \"org.local.base.key\"}}" "$1" 2>/dev/null || true; }

if [ "${FORCE:-0}" != 1 ] && [ "$(label "$IMAGE")" = "$key" ]; then
  log "$IMAGE exists (key $key): reused"
  echo "base_image_reused=1 base_key=$key"
  exit 0
fi
old_ids=$(podman image inspect --format '{{.Id}}' "$IMAGE" "$HEAVY" 2>/dev/null || true)
start=$(date +%s)
boot_s=0 copy_s=0 import_s=0 venv_s=0

if [ "${FORCE:-0}" != 1 ] && [ "$(label "$HEAVY")" = "$heavy_key" ]; then
  log "$HEAVY exists (key $heavy_key): reused"
else
  log "$HEAVY: building (key $heavy_key)"
  build_heavy
fi

build_top

# The finished image, as the Dockerfile will see it: with the CoreX PYTHONPATH, torch and vLLM
# import from the vendor's path and transformers from site-packages; without it, torch is absent.
check='import sys, torch, vllm, transformers
from vllm.platforms import current_platform
assert sys.version_info[:2] == (3, 10), sys.version
assert torch.__file__.startswith("'$COREX_SITE'/"), torch.__file__
assert vllm.__file__.startswith("'$COREX_SITE'/"), vllm.__file__
assert transformers.__file__.startswith("'$SITE'/"), transformers.__file__
assert transformers.__version__ == "4.51.3" and vllm.__version__.startswith("0.6.3")
assert current_platform.is_cpu() and torch.version.cuda is not None
import importlib
for name in "'"${pkgs[*]}"'".split():  # the top tier: from site-packages
    assert importlib.import_module(name).__file__.startswith("'$SITE'/"), name
x = torch.ones(4, 4) @ torch.ones(4, 4)
assert float(x.sum()) == 64.0
print("python", sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__,
      "transformers", transformers.__version__)'
if ! out=$(podman run --rm --network=none --pull=never \
    -e PYTHONPATH="$COREX_SITE:/usr/local/corex/lib/python3/dist-packages" \
    "$IMAGE" python3 -c "$check" 2>&1); then
  log "the stand-in base fails its own check:"; echo "$out" >&2
  podman rmi "$IMAGE" >/dev/null 2>&1 || true
  exit 1
fi
log "check: $(echo "$out" | tail -n 1)"
if podman run --rm --network=none --pull=never "$IMAGE" python3 -c 'import torch' >/dev/null 2>&1
then
  log "torch imports without the CoreX PYTHONPATH: the layout is not the vendor's"
  podman rmi "$IMAGE" >/dev/null 2>&1 || true
  exit 1
fi

# The images these replaced (untagged now) go, unless something still uses them.
for id in $old_ids; do
  podman image inspect --format '{{.RepoTags}}' "$id" 2>/dev/null | grep -q '\[\]' &&
    podman rmi "$id" >/dev/null 2>&1 || true
done
total_s=$(( $(date +%s) - start ))
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
log "built $IMAGE (key $key, packages tier $heavy_key): $(( size / 1024 / 1024 )) MiB; venv" \
  "${venv_s} s, debootstrap ${boot_s} s, copy ${copy_s} s, import ${import_s} s, top tier" \
  "${top_s} s, total ${total_s} s"
echo "base_image_reused=0 base_key=$key debootstrap_s=$boot_s base_total_s=$total_s" \
  "base_size_mib=$(( size / 1024 / 1024 ))"
}

main "$@"
