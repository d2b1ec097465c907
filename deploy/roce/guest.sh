#!/bin/bash
# deploy/roce/guest.sh -- run a command inside a throw-away QEMU guest that has real soft-RoCE (rdma_rxe)
# devices: the project's soft-RoCE lab on machines whose own kernel has no RDMA (see docs/roce.md).
#
#   bash deploy/roce/guest.sh setup [--timeout S]     # apt (qemu, rdma-core, python3-pyverbs 44) + kernel +
#                                                     # initramfs; cached, idempotent, locked
#   bash deploy/roce/guest.sh link-pyverbs [VENV]     # make Debian's pyverbs importable in VENV (default .venv)
#   bash deploy/roce/guest.sh check                   # what is ready, what is missing (exit 0 = ready)
#   bash deploy/roce/guest.sh run [--rxe N] [--mtu M] [--timeout S] [--boot-timeout S] [--mem MB] [--rw DIR] \
#        -- CMD ARGS...                               # e.g. -- .venv/bin/python -m pytest -q tests/roce
# Exit codes: setup/link-pyverbs/check: 0 ok, 2 usage, 3 failed (the message says why), 124 setup timed out.
#   run: CMD's own exit code, or 124 = total timeout (boot included), 125 = the lab failed (setup, boot, rxe
#   devices not ACTIVE, guest died). CMD's output is streamed to our stdout.
#
# The guest: Debian's stock kernel (linux-image-amd64, unpacked only, modules pruned) booted by QEMU with a
# busybox initramfs; its root filesystem is the host's own / over virtio-9p, read-only under a tmpfs overlay,
# so the host's Python, venv and rdma-core run unchanged. $PWD (or --rw DIR) is mounted read-write at the same
# path. The test network lives inside the guest (rxe-net.sh: rxe1..rxeN on 10.77.0.1..N, GID index 1).
# KVM where kvm_intel/kvm_amd is loaded, otherwise software emulation (TCG, ~20x slower: function, never
# performance). Environment: ROCE_GUEST_CACHE (default /var/cache/reduction-appliance/roce-guest),
# ROCE_GUEST_ACCEL=kvm|tcg, ROCE_GUEST_SMP (default nproc).
set -euo pipefail

CACHE=${ROCE_GUEST_CACHE:-/var/cache/reduction-appliance/roce-guest}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SELF="$HERE/$(basename "${BASH_SOURCE[0]}")"
HOST_PKGS=(qemu-system-x86 kmod cpio busybox-static rdma-core ibverbs-providers ibverbs-utils rdmacm-utils
           python3-pyverbs iproute2 procps)
INITRD_VERSION=3          # bump when build_initramfs changes: cached images are rebuilt
GUEST_MODULES="virtio_pci 9pnet_virtio 9p overlay virtiofs"

log() { echo "[roce-guest $(date +%T)] $*" >&2; }
die() { local rc=$1; shift; echo "[roce-guest $(date +%T)] ERROR: $*" >&2; exit "$rc"; }

# ---------------------------------------------------------------------------------------------- setup
pkgs_missing() {
  local p; for p in "${HOST_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

apt_q() {  # apt-get with bounded network waits and a wait (not a failure) on another apt's lock
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -o Acquire::http::Timeout=30 \
    -o Acquire::Retries=3 "$@"
}

kernel_pkg() {  # the versioned image linux-image-amd64 points to (follows Debian security updates)
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'
}

kernel_ok() {  # cached kernel complete?
  [ -s "$CACHE/kver" ] || return 1
  local k; k=$(cat "$CACHE/kver")
  [ -s "$CACHE/kroot/boot/vmlinuz-$k" ] && [ -s "$CACHE/kroot/lib/modules/$k/modules.dep" ] \
    && find "$CACHE/kroot/lib/modules/$k" -name 'rdma_rxe.ko*' | grep -q .
}

setup_locked() {
  local t0=$SECONDS
  [ "$(id -u)" = 0 ] || die 3 "setup needs root (apt-get; qemu's 9p export of / must read every file)"
  command -v apt-get >/dev/null && command -v dpkg-query >/dev/null || die 3 "needs Debian/Ubuntu apt"
  [ "$(uname -m)" = x86_64 ] || die 3 "x86_64 only (got $(uname -m))"
  local missing; missing=$(pkgs_missing | tr '\n' ' ')
  if [ -n "${missing// }" ]; then
    log "apt-get install (missing: $missing)"
    apt_q update -qq || die 3 "apt-get update failed"
    # shellcheck disable=SC2086
    apt_q install -y -qq --no-install-recommends $missing >/dev/null \
      || die 3 "apt-get install $missing failed"
    missing=$(pkgs_missing | tr '\n' ' ')
    [ -z "${missing// }" ] || die 3 "still missing after apt-get install: $missing"
  fi
  # Kernel: the package linux-image-amd64 points to, unpacked only (no initramfs-tools, no bootloader).
  if ! kernel_ok; then
    local kpkg; kpkg=$(kernel_pkg)
    [ -n "$kpkg" ] || { apt_q update -qq || true; kpkg=$(kernel_pkg); }
    [ -n "$kpkg" ] || die 3 "cannot resolve linux-image-amd64 to a kernel package (apt lists?)"
    log "downloading and unpacking $kpkg"
    local w; w=$(mktemp -d "$CACHE/.kernel.XXXXXX")
    if ! (cd "$w" && apt_q download "$kpkg" >/dev/null 2>&1); then
      apt_q update -qq || true      # stale lists: the versioned package may have left the mirror
      kpkg=$(kernel_pkg)
      (cd "$w" && apt_q download "$kpkg" >/dev/null) || { rm -rf "$w"; die 3 "apt-get download $kpkg failed"; }
    fi
    mkdir -p "$w/kroot"
    dpkg-deb -x "$w"/*.deb "$w/kroot" || { rm -rf "$w"; die 3 "dpkg-deb -x failed"; }
    local kver; kver=$(ls "$w/kroot/lib/modules")
    if [ "${ROCE_GUEST_PRUNE:-1}" = 1 ]; then   # 407 MB -> ~160 MB: nothing here is needed in a NIC-less guest
      local m="$w/kroot/lib/modules/$kver/kernel"
      rm -rf "$m/sound" "$m"/drivers/{gpu,media,staging,scsi,usb,hid,input,iio,bluetooth,mtd,isdn,hwmon} \
             "$m"/drivers/net/{wireless,ethernet,usb,can,ieee802154,wwan} "$m"/drivers/infiniband/hw "$w/kroot/usr"
    fi
    depmod -b "$w/kroot" "$kver" || { rm -rf "$w"; die 3 "depmod failed"; }
    rm -rf "$CACHE/kroot" "$CACHE/initrd.img" "$CACHE/initrd.version"
    mv "$w/kroot" "$CACHE/kroot"; rm -rf "$w"
    echo "$kver" > "$CACHE/kver"          # written last: an interrupted setup is redone
    kernel_ok || die 3 "kernel cache incomplete after unpacking $kpkg"
  fi
  local kver; kver=$(cat "$CACHE/kver")
  if [ ! -s "$CACHE/initrd.img" ] || [ "$(cat "$CACHE/initrd.version" 2>/dev/null)" != "$INITRD_VERSION-$kver" ]; then
    build_initramfs "$kver"
  fi
  log "setup done in $((SECONDS - t0)) s (kernel $kver, cache $(du -sh "$CACHE" 2>/dev/null | cut -f1))"
}

setup() {
  local timeout=${ROCE_GUEST_SETUP_TIMEOUT:-900}
  while [ $# -gt 0 ]; do
    case $1 in --timeout) timeout=$2; shift 2;; *) die 2 "setup: unknown option $1";; esac
  done
  mkdir -p "$CACHE" || die 3 "cannot create $CACHE"
  # one setup at a time per cache (parallel CI jobs on one machine); the whole setup is time-bounded
  local rc=0
  timeout -k 10 "$timeout" flock "$CACHE/.lock" bash "$SELF" _setup_locked || rc=$?
  [ $rc -eq 124 ] && log "ERROR: setup timed out after ${timeout}s"
  return $rc
}

build_initramfs() {
  local kver=$1 w; w=$(mktemp -d)
  mkdir -p "$w"/{bin,dev,proc,sys,mnt/lower,mnt/rw,newroot,lib/modules}
  cp /bin/busybox "$w/bin/busybox"
  mknod "$w/dev/console" c 5 1; mknod "$w/dev/null" c 1 3
  local i=0 f
  # shellcheck disable=SC2086
  for f in $(for m in $GUEST_MODULES; do
               modprobe --show-depends -d "$CACHE/kroot" -S "$kver" $m | awk '/^insmod/{print $2}'; done | awk '!s[$0]++'); do
    i=$((i + 1)); cp "$f" "$w/lib/modules/$(printf %02d $i)-$(basename "$f")"
  done
  [ $i -ge 5 ] || die 3 "initramfs: found only $i modules for: $GUEST_MODULES"
  cat > "$w/init" <<'EOI'
#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc; $B mount -t sysfs sys /sys; $B mount -t devtmpfs dev /dev
for m in $($B ls /lib/modules); do $B insmod /lib/modules/$m || echo "insmod $m failed"; done
STAGE2=/bin/sh; ROOTFS=9p; ROOTMODE=overlay
for a in $($B cat /proc/cmdline); do case $a in stage2=*) STAGE2=${a#stage2=};; rootfs=*) ROOTFS=${a#rootfs=};; rootmode=*) ROOTMODE=${a#rootmode=};; esac; done
fail() { echo "roce-guest initramfs: $*"; $B sleep 1; echo o > /proc/sysrq-trigger; $B sleep 30; }
if [ $ROOTFS = virtiofs ]; then
  $B mount -t virtiofs -o ro hostroot /mnt/lower || fail "virtiofs mount failed"
else
  $B mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /mnt/lower || fail "9p mount failed"
fi
if [ $ROOTMODE = overlay ]; then
  $B mount -t tmpfs -o size=80% rw /mnt/rw; $B mkdir -p /mnt/rw/upper /mnt/rw/work
  $B mount -t overlay -o lowerdir=/mnt/lower,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work overlay /newroot || fail "overlay failed"
else
  $B mount --move /mnt/lower /newroot
fi
[ -f "/newroot$STAGE2" ] || fail "stage2 $STAGE2 not found in the host root"
$B mount --move /dev /newroot/dev; $B umount /proc /sys
exec $B switch_root /newroot /bin/bash $STAGE2
EOI
  chmod +x "$w/init"
  (cd "$w" && find . | cpio -o -H newc --quiet) | gzip -1 > "$CACHE/initrd.img.tmp"
  mv "$CACHE/initrd.img.tmp" "$CACHE/initrd.img"; echo "$INITRD_VERSION-$kver" > "$CACHE/initrd.version"
  rm -rf "$w"
}

# --------------------------------------------------------------------------------------- link-pyverbs
link_pyverbs() {  # Debian's pyverbs is built for the cpython-311 ABI: link it into a 3.11 venv
  local venv=${1:-.venv} src=/usr/lib/python3/dist-packages/pyverbs
  [ -d "$src" ] || die 3 "$src missing: run '$0 setup' first (package python3-pyverbs)"
  [ -x "$venv/bin/python" ] || die 3 "no venv at $venv (expected $venv/bin/python)"
  local ver site
  ver=$("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$ver" = 3.11 ] || die 3 "$venv is Python $ver; Debian bookworm's pyverbs only loads in CPython 3.11"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # A symlink of the package alone, not a .pth of all of dist-packages (that would also expose Debian's pip,
  # setuptools hacks, cryptography, ... to the venv).
  ln -sfn "$src" "$site/pyverbs"
  "$venv/bin/python" -c 'import pyverbs.device, pyverbs.cmid, pyverbs.qp' \
    || die 3 "pyverbs linked into $site but does not import"
  log "pyverbs (rdma-core $(dpkg-query -W -f='${Version}' python3-pyverbs)) linked into $site"
}

check() {
  local ok=0
  [ "$(id -u)" = 0 ] || { echo "not root"; ok=3; }
  local m; m=$(pkgs_missing | tr '\n' ' ')
  [ -z "${m// }" ] && echo "packages: ok" || { echo "packages missing: $m"; ok=3; }
  kernel_ok && echo "kernel: $(cat "$CACHE/kver") in $CACHE" || { echo "kernel: not cached"; ok=3; }
  [ "$(cat "$CACHE/initrd.version" 2>/dev/null)" = "$INITRD_VERSION-$(cat "$CACHE/kver" 2>/dev/null)" ] \
    && echo "initramfs: ok" || { echo "initramfs: missing or stale"; ok=3; }
  echo "accel: $(pick_accel)"
  return $ok
}

pick_accel() {
  if [ -n "${ROCE_GUEST_ACCEL:-}" ]; then echo "$ROCE_GUEST_ACCEL"
  elif [ -w /dev/kvm ] && { [ -d /sys/module/kvm_intel ] || [ -d /sys/module/kvm_amd ]; }; then echo kvm
  else echo tcg; fi
}

# ------------------------------------------------------------------------------------------------ run
QPID="" TPID="" VFSPID="" JOB=""
cleanup() {
  local p; for p in $QPID $TPID $VFSPID; do kill "$p" 2>/dev/null || true; done
  for p in $QPID $TPID $VFSPID; do wait "$p" 2>/dev/null || true; done
  [ -n "$JOB" ] && rm -rf "$JOB"
  return 0
}

run() {
  # A boot takes about 5 s; the bound on it only catches a hung one. It was 180 s until a CI
  # run's guest, booting beside the RoCE stage's guest and the host's tests on two CPUs, stalled
  # 156 s in the kernel's crypto self-tests (soft lockup, 2026-12-07): starved, not hung.
  local rxe=3 mtu=9000 timeout=3600 boot_timeout=360 mem=4096 rw=$PWD smp=${ROCE_GUEST_SMP:-$(nproc)}
  while [ $# -gt 0 ]; do
    case $1 in
      --rxe) rxe=$2; shift 2;; --mtu) mtu=$2; shift 2;; --timeout) timeout=$2; shift 2;;
      --boot-timeout) boot_timeout=$2; shift 2;; --mem) mem=$2; shift 2;;
      --rw) [ -d "$2" ] || die 2 "--rw $2: not a directory"; rw=$(cd "$2" && pwd); shift 2;;
      --) shift; break;; -*) die 2 "run: unknown option $1";; *) break;;
    esac
  done
  [ $# -gt 0 ] || die 2 "usage: $0 run [--rxe N] [--mtu M] [--timeout S] [--boot-timeout S] [--mem MB] [--rw DIR] -- CMD..."
  [[ $rxe =~ ^[0-9]+$ && $timeout =~ ^[0-9]+$ && $mem =~ ^[0-9]+$ ]] || die 2 "--rxe/--timeout/--mem take integers"
  local t0=$SECONDS
  if ! check >/dev/null 2>&1; then
    log "cache incomplete: running setup first"
    setup || { log "ERROR: setup failed"; return 125; }
  fi
  local kver; kver=$(cat "$CACHE/kver")
  local accel; accel=$(pick_accel)
  local cpu accelopt
  if [ "$accel" = kvm ]; then accelopt="-accel kvm"; cpu="host"; else accelopt="-accel tcg,thread=multi"; cpu="max"; fi
  trap cleanup EXIT; trap 'exit 130' INT; trap 'exit 143' TERM
  # job directory: command, env and results travel through it (shared read-write over 9p)
  mkdir -p "$CACHE/jobs"
  JOB=$(mktemp -d "$CACHE/jobs/job.XXXXXX"); local job=$JOB
  printf '%q ' "$@" > "$job/cmd"
  { printf 'cd %q\n' "$PWD"
    export -p | grep -vE '^declare -x (BASH_|SHLVL|OLDPWD|PWD|_=|TERM=|SHELL=|HOSTNAME=|SSH_|DISPLAY=|XDG_)' || true
  } > "$job/env"
  echo "$rxe" > "$job/rxe"; echo "$mtu" > "$job/mtu"; echo "$rw" > "$job/rwdir"
  echo "$CACHE/kroot/lib/modules/$kver" > "$job/modules"; echo "$HERE/rxe-net.sh" > "$job/rxe-net"
  : > "$job/output.log"
  local rootfs=${ROCE_GUEST_ROOTFS:-9p} rootmode=${ROCE_GUEST_ROOTMODE:-overlay} rootdev
  if [ "$rootfs" = virtiofs ]; then
    /usr/lib/qemu/virtiofsd --socket-path="$job/vfs.sock" -o source=/ -o cache=always -o sandbox=chroot \
        --thread-pool-size=4 >"$job/virtiofsd.log" 2>&1 &
    VFSPID=$!
    for _ in $(seq 50); do [ -S "$job/vfs.sock" ] && break; sleep 0.1; done
    rootdev="-object memory-backend-memfd,id=mem,size=${mem}M,share=on -numa node,memdev=mem
             -chardev socket,id=vfs,path=$job/vfs.sock -device vhost-user-fs-pci,chardev=vfs,tag=hostroot"
  else
    rootdev="-virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
  fi
  # cryptomgr.notests: the kernel's self-tests of its crypto algorithms prove nothing here
  # (0.3 s of a 4.7 s boot to init, measured; the stalled boot above was in them).
  log "booting guest (accel=$accel, smp=$smp, mem=${mem}M, rxe=$rxe, mtu=$mtu, root=$rootfs/$rootmode) to run: $*"
  # shellcheck disable=SC2086
  qemu-system-x86_64 $accelopt -cpu "$cpu" -M pc -m "$mem" -smp "$smp" \
      -nodefaults -no-user-config -display none -no-reboot -serial "file:$job/console.log" \
      -kernel "$CACHE/kroot/boot/vmlinuz-$kver" -initrd "$CACHE/initrd.img" \
      -append "console=ttyS0 loglevel=3 panic=-1 mitigations=off cryptomgr.notests rootfs=$rootfs rootmode=$rootmode stage2=$HERE/guest-init.sh roceguest_job=$job" \
      $rootdev \
      -virtfs "local,path=$job,mount_tag=job,security_model=none,multidevs=remap" \
      -virtfs "local,path=$rw,mount_tag=rwdir,security_model=none,multidevs=remap" \
      </dev/null >"$job/qemu.log" 2>&1 &
  QPID=$!
  tail -n +1 -F "$job/output.log" 2>/dev/null &
  TPID=$!
  # watchdog: total timeout, and a separate bound on reaching the guest's init (a hung boot fails fast)
  local why="" tb=$SECONDS
  while kill -0 "$QPID" 2>/dev/null; do
    if [ $((SECONDS - tb)) -ge "$timeout" ]; then why=timeout; break; fi
    if [ ! -s "$job/timings" ] && [ $((SECONDS - tb)) -ge "$boot_timeout" ]; then why=boot; break; fi
    sleep 0.5
  done
  if [ -n "$why" ]; then kill "$QPID" 2>/dev/null || true; fi
  local qrc=0; wait "$QPID" || qrc=$?; QPID=""
  sleep 0.3; kill "$TPID" 2>/dev/null || true; wait "$TPID" 2>/dev/null || true; TPID=""
  cp "$job/output.log" "$CACHE/last-output.log"; cp "$job/console.log" "$CACHE/last-console.log" 2>/dev/null || true
  local rc
  if [ "$why" = timeout ]; then
    log "TIMEOUT: guest killed after ${timeout}s"; rc=124
  elif [ "$why" = boot ]; then
    log "INFRA FAILURE: guest did not reach init within ${boot_timeout}s; console tail:"
    tail -20 "$job/console.log" >&2 || true; rc=125
  elif [ -s "$job/infra_error" ]; then
    log "INFRA FAILURE in the guest: $(cat "$job/infra_error")"; rc=125
  elif [ -s "$job/rc" ]; then
    rc=$(cat "$job/rc")
  else
    log "INFRA FAILURE: guest ended without a result (qemu rc=$qrc); console tail:"
    tail -30 "$job/console.log" >&2 || true; cat "$job/qemu.log" >&2 || true; rc=125
  fi
  log "guest done in $((SECONDS - tb)) s (run total $((SECONDS - t0)) s), rc=$rc (guest clock: $(tr '\n' ' ' < "$job/timings" 2>/dev/null))"
  return "$rc"
}

case ${1:-} in
  setup) shift; setup "$@";;
  _setup_locked) setup_locked;;
  link-pyverbs) shift; link_pyverbs "$@";;
  check) check;;
  run) shift; run "$@";;
  *) sed -n '2,13p' "$0"; exit 2;;
esac
