#!/usr/bin/env bash
# Install the reduction appliance on a rack server from this repository checkout.
#
#   sudo bash deploy/install.sh [--dry-run] [--data-if IF] [--prefix DIR] [--skip-venv]
#
# Idempotent: run it again after `git pull` to upgrade. It never overwrites the operator's
# config or token; it does replace the unit file and the sysctl file (ours; customise through
# `systemctl edit reductiond` and a later-sorting /etc/sysctl.d file).
#
#   --dry-run     print every action, change nothing (no root needed)
#   --data-if IF  the data NIC: also set its rp_filter (see host-tuning.md)
#   --prefix DIR  install files under DIR instead of / (packaging, tests); then users,
#                 sysctl and systemctl, which act on the running host, are only printed
#   --skip-venv   leave /opt/reduction-appliance/.venv alone (managed some other way)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
user=reduction
dry_run=false
skip_venv=false
prefix=/
data_if=""

usage() { sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while (($#)); do
    case "$1" in
        --dry-run) dry_run=true ;;
        --skip-venv) skip_venv=true ;;
        --prefix) prefix="${2:?--prefix needs a directory}"; shift ;;
        --data-if) data_if="${2:?--data-if needs an interface name}"; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

if [[ -n "$data_if" && ! "$data_if" =~ ^[A-Za-z0-9_.-]{1,15}$ ]]; then
    echo "install.sh: --data-if $data_if is not an interface name" >&2
    exit 2
fi
if ! $dry_run && ((EUID != 0)); then
    echo "install.sh: must run as root (creates a user, writes /etc and /opt); try --dry-run" >&2
    exit 1
fi
if [[ ! -f "$repo/pyproject.toml" ]]; then
    echo "install.sh: $repo is not a reduction-appliance checkout (no pyproject.toml)" >&2
    exit 1
fi

prefix="${prefix%/}"  # "/" -> "", "/tmp/x/" -> "/tmp/x": paths below start with "/"
on_host=false
[[ -z "$prefix" ]] && on_host=true
opt="$prefix/opt/reduction-appliance"
etc="$prefix/etc/reduction-appliance"
unit="$prefix/etc/systemd/system/reductiond.service"
sysctl_file="$prefix/etc/sysctl.d/60-reduction-appliance.conf"

say() { echo "install.sh: $*"; }
# Run a command, or only show it under --dry-run.
run() {
    echo "+ $*"
    $dry_run || "$@"
}
# Commands that change the running host (users, kernel settings, systemd), not just files.
host_run() {
    if $on_host; then
        run "$@"
    else
        echo "+ (host only, skipped with --prefix) $*"
    fi
}
# Group that may read the config and token: the service's, once it exists.
owner_args() {
    if $on_host; then echo "-o root -g $user"; fi
}

# 1. The service user: system account, no login, no home of its own.
if $on_host && getent passwd "$user" >/dev/null; then
    say "user $user exists"
else
    host_run useradd --system --user-group --no-create-home \
        --home-dir /var/lib/reduction-appliance --shell /usr/sbin/nologin "$user"
fi

# 2. The program: its own venv, so the system Python stays untouched. torch is pinned in
#    pyproject.toml; a plain PyPI index may pull a large CUDA build (set PIP_INDEX_URL or
#    PIP_EXTRA_INDEX_URL, e.g. https://download.pytorch.org/whl/cpu, for CPU-only wheels).
if $skip_venv; then
    say "skipping the venv (--skip-venv)"
else
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "install.sh: $python is not Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
        exit 1
    fi
    if [[ -x "$opt/.venv/bin/python" ]]; then
        say "venv $opt/.venv exists"
    else
        run install -d -m 0755 "$opt"
        run "$python" -m venv "$opt/.venv"
    fi
    run "$opt/.venv/bin/pip" install --upgrade --quiet "$repo[torch]"
fi
run install -D -m 0644 "$repo/deploy/host-tuning.md" "$opt/host-tuning.md"
run install -D -m 0644 "$repo/deploy/prometheus/alerts.yml" "$opt/prometheus/alerts.yml"

# 3. Configuration: the annotated reference, only when the operator has none yet.
run install -d -m 0750 $(owner_args) "$etc"
if [[ -e "$etc/appliance.toml" ]]; then
    say "$etc/appliance.toml exists: kept (compare with $repo/deploy/appliance.toml)"
else
    run install -m 0640 $(owner_args) "$repo/deploy/appliance.toml" "$etc/appliance.toml"
    # A rack appliance authenticates its TCP API (the reference leaves it open for labs), and
    # steers onto the data NIC when we were told which one it is.
    run sed -i -e 's|^token_file = ""|token_file = "/etc/reduction-appliance/token"|' \
        "$etc/appliance.toml"
    if [[ -n "$data_if" ]]; then
        run sed -i -e "s|^interface = \"\"|interface = \"$data_if\"|" "$etc/appliance.toml"
    fi
fi

# 4. API token: 32 random bytes as hex, readable by the service's group only.
if [[ -e "$etc/token" ]]; then
    say "$etc/token exists: kept"
else
    echo "+ write 32 random bytes as hex to $etc/token (mode 0640)"
    if ! $dry_run; then
        (
            umask 077  # never readable by others, not even between creation and chmod
            od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$etc/token"
            echo >>"$etc/token"
        )
        chmod 0640 "$etc/token"
        $on_host && chown "root:$user" "$etc/token"
    fi
fi

# 5. The systemd unit (ours: replaced on every run; site changes go in drop-ins).
run install -D -m 0644 "$repo/deploy/reductiond.service" "$unit"

# 6. Kernel settings (why: deploy/host-tuning.md).
sysctls="# Written by reduction-appliance deploy/install.sh; replaced on every install.
# Socket buffers up to 64 MiB: a data-plane core absorbs a burst of every worker's window.
net.core.rmem_max = 67108864
net.core.wmem_max = 67108864
# One multicast group per job: allow many memberships per socket (default 20).
net.ipv4.igmp_max_memberships = 1024
# Loose reverse-path filtering: strict mode (1) silently drops workers' datagrams whose source
# is routed through another interface (multi-homed hosts); loose (2) still drops unroutable
# sources. The kernel uses the larger of 'all' and the interface's value.
net.ipv4.conf.all.rp_filter = 2
net.ipv4.conf.default.rp_filter = 2"
if [[ -n "$data_if" ]]; then
    sysctls+=$'\n'"net.ipv4.conf.${data_if//./\/}.rp_filter = 2"
fi
echo "+ write $sysctl_file"
if $dry_run; then
    sed 's/^/    /' <<<"$sysctls"
else
    install -d -m 0755 "$(dirname "$sysctl_file")"
    printf '%s\n' "$sysctls" >"$sysctl_file"
    chmod 0644 "$sysctl_file"
fi
# -e: a --data-if that does not exist yet (renamed NIC, not plugged) must not abort the install.
host_run sysctl -e -q -p "$sysctl_file"

# 7. Let systemd see the (new) unit.
if ! $on_host || [[ -d /run/systemd/system ]]; then
    host_run systemctl daemon-reload
else
    say "systemd is not running here: skipped daemon-reload"
fi

cat <<EOF

Next steps:
  1. Edit $etc/appliance.toml: dataplane.address and dataplane.interface (the data NIC),
     cores, cpus, api.listen.
  2. Match CPUAffinity to the CPUs not in dataplane.cpus:  systemctl edit reductiond
  3. Tune the host (isolated CPUs, NIC IRQs, MTU 9000, switch IGMP): $opt/host-tuning.md
  4. Start it:  systemctl enable --now reductiond   and watch:  journalctl -u reductiond -f
  5. Workers need the token in $etc/token to register jobs (api.token_file).
  6. Prometheus: scrape http://<api.listen>/metrics as job "reductiond" (bearer token above)
     and load the alerting rules $opt/prometheus/alerts.yml (README, "Alerts").
EOF
$dry_run && say "dry run: nothing was changed"
exit 0
