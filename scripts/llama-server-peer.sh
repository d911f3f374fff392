#!/usr/bin/env bash
# llama.cpp's own server (llama-server, Debian sid's llama.cpp-tools) as a benchmark peer.
#
# The "container" is a debootstrapped Debian sid tree entered with chroot inside a private
# mount namespace (unshare -m): /proc, /sys and /dev are bind-mounted into it, the model's
# folder read-only at /models. The network namespace is the host's, so the server listens on
# the host's loopback. When llama-server exits the namespace and its mounts go with it.
# (Docker works too, with care, on this kind of machine; a chroot needs no daemon, no image
# import and no network set-up, so it is the one supported here.)
#
#   sudo scripts/llama-server-peer.sh build                 # once: debootstrap sid + llama.cpp-tools
#   sudo scripts/llama-server-peer.sh serve --model F.gguf --port 8091 [--threads 2]
#                                           [--parallel 1] [--ctx-size 4096] [-- extra args]
#   sudo scripts/llama-server-peer.sh quantize SRC.gguf DST.gguf TYPE [--threads N] [llama-quantize options]
#   scripts/llama-server-peer.sh version | path
#
# serve execs llama-server in the foreground (stop it with SIGTERM / Ctrl-C); --threads goes to
# both -t and -tb, --parallel to --parallel (slots; each slot gets ctx-size / parallel tokens).
#
# Environment: KVSERVE_BENCH_CACHE (default ~/.cache/kvserve-bench; the tree is
# $KVSERVE_BENCH_CACHE/llama-sid-rootfs), LLAMA_PEER_ROOTFS (the tree itself),
# DEBIAN_MIRROR (default http://deb.debian.org/debian).
# Needs root (debootstrap, unshare -m, mount, chroot) and debootstrap (apt-get install debootstrap).
set -Eeuo pipefail

CACHE=${KVSERVE_BENCH_CACHE:-$HOME/.cache/kvserve-bench}
ROOTFS=${LLAMA_PEER_ROOTFS:-$CACHE/llama-sid-rootfs}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SERVER_BIN=/usr/bin/llama-server
QUANTIZE_BIN=/usr/bin/llama-quantize

die() { echo "llama-server-peer: $*" >&2; exit 1; }
usage() { sed -n '2,/^set -E/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
need_root() { [[ $(id -u) == 0 ]] || die "$1 needs root (debootstrap / unshare -m / chroot)"; }
built() { [[ -x $ROOTFS$SERVER_BIN && -f $ROOTFS/.kvserve-peer-ready ]]; }
need_built() { built || die "no llama-server in $ROOTFS: build it once with 'sudo $0 build'"; }

# Runs "$@" chrooted into the tree, in a private mount namespace; the folders named in
# BIND_RO (host paths) appear read-only under /models/<index> inside.
in_tree() {
    local script='set -e
root=$1; shift
mount --rbind /proc "$root/proc"; mount --rbind /sys "$root/sys"; mount --rbind /dev "$root/dev"
i=0
for dir in $BIND_RO; do
    mkdir -p "$root/models/$i"; mount --bind "$dir" "$root/models/$i"; mount -o remount,bind,ro "$root/models/$i"
    i=$((i + 1))
done
exec chroot "$root" "$@"'
    export BIND_RO
    exec unshare --mount --propagation private -- /bin/bash -c "$script" in_tree "$ROOTFS" "$@"
}

cmd_build() {
    need_root build
    if built; then echo "already built: $ROOTFS ($(cmd_version))"; return 0; fi
    command -v debootstrap >/dev/null || die "debootstrap is missing: apt-get install debootstrap"
    local tmp=$ROOTFS.tmp log=$CACHE/llama-sid-build.log
    mkdir -p "$CACHE"
    rm -rf "$tmp"
    echo "debootstrap sid into $tmp (log: $log) ..."
    debootstrap --variant=minbase sid "$tmp" "$MIRROR" >"$log" 2>&1 \
        || { tail -n 20 "$log" >&2; die "debootstrap failed"; }
    echo "apt-get install llama.cpp-tools inside the tree ..."
    # sid's Release file on this mirror can be past its Valid-Until date.
    cp -L /etc/resolv.conf "$tmp/etc/resolv.conf" 2>/dev/null || true
    (ROOTFS=$tmp BIND_RO=; in_tree /bin/sh -c '
        apt-get -o Acquire::Check-Valid-Until=false update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends llama.cpp-tools &&
        apt-get clean && rm -rf /var/lib/apt/lists/*') >>"$log" 2>&1 \
        || { tail -n 20 "$log" >&2; die "apt-get install llama.cpp-tools failed"; }
    [[ -x $tmp$SERVER_BIN ]] || die "llama.cpp-tools did not bring $SERVER_BIN"
    mkdir -p "$tmp/models"
    chroot "$tmp" dpkg-query -W -f '${Version}\n' llama.cpp-tools >"$tmp/.kvserve-peer-ready"
    rm -rf "$ROOTFS"
    mv "$tmp" "$ROOTFS"
    echo "built: $ROOTFS (llama.cpp-tools $(cmd_version), $(du -sh "$ROOTFS" | cut -f1))"
}

cmd_version() { need_built; cat "$ROOTFS/.kvserve-peer-ready"; }

cmd_serve() {
    need_root serve
    need_built
    local model= port= threads=2 parallel=1 ctx=4096 extra=()
    while (($#)); do
        case $1 in
            --model) model=$2; shift 2 ;;
            --port) port=$2; shift 2 ;;
            --threads) threads=$2; shift 2 ;;
            --parallel) parallel=$2; shift 2 ;;
            --ctx-size) ctx=$2; shift 2 ;;
            --) shift; extra=("$@"); break ;;
            *) die "serve: unknown option $1" ;;
        esac
    done
    [[ -n $model && -f $model ]] || die "serve: --model must name a GGUF file (got '${model}')"
    [[ -n $port ]] || die "serve: --port is required"
    model=$(realpath "$model")
    BIND_RO=$(dirname "$model")
    in_tree "$SERVER_BIN" --model "/models/0/$(basename "$model")" \
        --host 127.0.0.1 --port "$port" -t "$threads" -tb "$threads" --parallel "$parallel" \
        --ctx-size "$ctx" --no-webui "${extra[@]}"
}

cmd_quantize() {
    need_root quantize
    need_built
    (($# >= 3)) || die "quantize SRC DST TYPE [llama-quantize options]"
    local src dst type
    src=$(realpath "$1"); dst=$(realpath -m "$2"); type=$3; shift 3
    [[ -f $src ]] || die "quantize: no such file $src"
    mkdir -p "$(dirname "$dst")"
    # the destination folder is bound writable at /out, the source folder read-only at /models/0
    local script='set -e
root=$1 src=$2 dst=$3; shift 3
mount --rbind /proc "$root/proc"; mount --rbind /dev "$root/dev"
mkdir -p "$root/models/0" "$root/out"
mount --bind "$(dirname "$src")" "$root/models/0"; mount -o remount,bind,ro "$root/models/0"
mount --bind "$(dirname "$dst")" "$root/out"
exec chroot "$root" '"$QUANTIZE_BIN"' "$@"'
    local opts=() nthreads=()
    while (($#)); do
        case $1 in
            --threads) nthreads=("$2"); shift 2 ;;
            *) opts+=("$1"); shift ;;
        esac
    done
    # llama-quantize [options] SRC DST TYPE [nthreads]
    exec unshare --mount --propagation private -- /bin/bash -c "$script" quantize "$ROOTFS" "$src" "$dst" \
        "${opts[@]}" "/models/0/$(basename "$src")" "/out/$(basename "$dst")" "$type" "${nthreads[@]}"
}

case ${1:-} in
    build) shift; cmd_build "$@" ;;
    serve) shift; cmd_serve "$@" ;;
    quantize) shift; cmd_quantize "$@" ;;
    version) cmd_version ;;
    path) echo "$ROOTFS" ;;
    -h|--help|help|'') usage ;;
    *) die "unknown command $1 (see --help)" ;;
esac
