#!/bin/bash
# HOW TO RUN: inside the guest.sh guest (it runs this itself with --rxe N), or any root shell on a Linux with
# rdma_rxe + veth + bridge modules:  RXE_MTU=9000 bash rxe-net.sh 3   -> rxe1..rxe3 on h1..h3 (10.77.0.1..3).
# rxe-net.sh N  -- create N soft-RoCE endpoints rxe1..rxeN on veth ports of bridge br0, all in the init netns
# (rxe in kernel 6.1 only works in init_net), addresses 10.77.0.1..N, netdev MTU $RXE_MTU (default 9000, which
# gives rxe an active MTU of 4096, the RoCE maximum; 1500 gives 1024).
# Policy routing ("oif hX -> table") makes traffic between two local addresses really cross the veth/bridge
# instead of being short-cut through 'lo' (rxe drops packets that arrive on a netdev with no rxe device).
# Exit code 0 only if all N ports are ACTIVE.
set -euo pipefail
N=${1:-3}
MTU=${RXE_MTU:-9000}
trap 'echo "rxe-net.sh: failed at line $LINENO: $BASH_COMMAND" >&2' ERR
modprobe -a rdma_rxe veth bridge
# one `ip -batch` and /proc writes instead of ~12 processes per endpoint: process start-up dominates under TCG
{
  echo "link add br0 type bridge mcast_snooping 0"
  echo "link set br0 mtu $MTU up"
  echo "rule add pref 1000 lookup local"        # move the 'local' rule after our oif rules
  echo "rule del pref 0 lookup local"
  for i in $(seq 1 "$N"); do
    echo "link add h$i mtu $MTU type veth peer name h$i-br mtu $MTU"
    echo "link set h$i-br master br0"
    echo "link set h$i-br up"
    echo "address add 10.77.0.$i/24 dev h$i"
    echo "link set h$i up"
    echo "route add 10.77.0.0/24 dev h$i src 10.77.0.$i table $((100+i))"
    echo "route add 224.0.0.0/4 dev h$i src 10.77.0.$i table $((100+i))"
    echo "rule add pref 10 oif h$i lookup $((100+i))"
    echo "rule add pref 5 oif h$i to 10.77.0.$i lookup local"   # a device talking to itself: keep rxe's loopback path
  done
} > /tmp/rxe-net.ip
ip -batch /tmp/rxe-net.ip
for k in all default $(seq -f 'h%g' 1 "$N"); do   # accept_local: local source addresses on hX; no rp_filter
  printf '%s\n' 1 > /proc/sys/net/ipv4/conf/$k/accept_local
  printf '%s\n' 0 > /proc/sys/net/ipv4/conf/$k/rp_filter
  printf '%s\n' 1 > /proc/sys/net/ipv4/conf/$k/arp_ignore
  printf '%s\n' 2 > /proc/sys/net/ipv4/conf/$k/arp_announce
done
for i in $(seq 1 "$N"); do rdma link add rxe$i type rxe netdev h$i; done
# wait for ports to be ACTIVE (and fail loudly if they do not become so)
for _ in $(seq 1 100); do
  [ "$(rdma link | grep -c 'state ACTIVE')" -ge "$N" ] && break; sleep 0.1
done
rdma link
active=$(rdma link | grep -c 'state ACTIVE' || true)
[ "$active" -ge "$N" ] || { echo "rxe-net.sh: only $active of $N rxe ports ACTIVE" >&2; exit 1; }
