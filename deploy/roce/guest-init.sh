#!/bin/bash
# deploy/roce/guest-init.sh -- PID 1 inside the guest.sh guest (never run on the host).
# guest.sh passes it as stage2= on the kernel command line; the busybox initramfs switch_roots into the
# host's / (9p, read-only + tmpfs overlay) and execs it. It mounts the job and read-write shares, sets up
# rxe1..rxeN (rxe-net.sh), runs the job's command, writes its exit code to $job/rc (or a reason to
# $job/infra_error) and powers the VM off.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
poweroff_now() { sync; echo o > /proc/sysrq-trigger; sleep 30; }
mount -t proc proc /proc; mount -t sysfs sys /sys
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm; mount -t tmpfs tmpfs /run
job=$(sed -n 's/.*roceguest_job=\([^ ]*\).*/\1/p' /proc/cmdline)
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none job "$job" || { echo "job mount failed"; poweroff_now; }
infra() { echo "$*" > "$job/infra_error"; echo "roce guest: $*" >> "$job/output.log"; poweroff_now; }
rwdir=$(cat "$job/rwdir")
mkdir -p "$rwdir" && mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap rwdir "$rwdir" \
  || infra "mounting the read-write directory $rwdir failed"
kver=$(uname -r)
mkdir -p "/lib/modules/$kver" && mount --bind "$(cat "$job/modules")" "/lib/modules/$kver" \
  || infra "binding the kernel modules failed"
hostname roceguest; ip link set lo up
ulimit -l unlimited                                   # registered memory is pinned: no memlock limit
echo "boot_to_init_s=$(cut -d' ' -f1 /proc/uptime)" > "$job/timings"
n=$(cat "$job/rxe")
if [ "$n" -gt 0 ]; then
  RXE_MTU=$(cat "$job/mtu") bash "$(cat "$job/rxe-net")" "$n" > "$job/rxe-net.log" 2>&1 \
    || infra "rxe-net.sh $n failed: $(tail -5 "$job/rxe-net.log" | tr '\n' ' ')"
fi
echo "rxe_ready_s=$(cut -d' ' -f1 /proc/uptime)" >> "$job/timings"
( set -a; source "$job/env"; set +a; export ROCE_GUEST=1 ROCE_GUEST_RXE="$n"
  eval "exec $(cat "$job/cmd")" ) < /dev/null >> "$job/output.log" 2>&1
rc=$?
echo "cmd_done_s=$(cut -d' ' -f1 /proc/uptime)" >> "$job/timings"
echo $rc > "$job/rc"
poweroff_now
