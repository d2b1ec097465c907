# System tools the emulated rack (deploy/testnet) needs: ip/tc (iproute2), nft (nftables) for
# loss/duplication/reordering, ping (iputils-ping). Sourced by scripts/main and scripts/test:
#
#     source "$repo/scripts/_deps.sh"
#
# As root, installs whatever of them is missing (Debian/Ubuntu apt-get) and says so in one line.
# Not root: says that namespace tests will be skipped. Never fails or exits the sourcing script,
# whatever its `set -e`; it only defines names starting with _deps_.

_deps_ensure_lab_tools() {
    local -A package_of=([ip]=iproute2 [tc]=iproute2 [nft]=nftables [ping]=iputils-ping)
    local tool missing=() log
    for tool in ip tc nft ping; do
        if ! command -v "$tool" >/dev/null 2>&1 \
            && [[ " ${missing[*]} " != *" ${package_of[$tool]} "* ]]; then
            missing+=("${package_of[$tool]}")
        fi
    done
    if [[ "$(id -u)" != 0 ]]; then
        echo "deps: not root: network-namespace tests (tests/netns) will be skipped" >&2
        return 0
    fi
    (( ${#missing[@]} )) || return 0
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "deps: missing ${missing[*]} and no apt-get to install them; some namespace tests" \
            "will be skipped" >&2
        return 0
    fi
    log="$(mktemp)"
    # The package lists may be absent (fresh container) or stale: update only if install fails.
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >"$log" 2>&1 \
        || { apt-get update -q >>"$log" 2>&1 \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" \
                >>"$log" 2>&1; }; then
        echo "deps: installed ${missing[*]} (for the emulated network in tests/netns)" >&2
    else
        echo "deps: could not install ${missing[*]}; some namespace tests will be skipped" \
            "(apt-get said: $(tail -n 1 "$log"))" >&2
    fi
    rm -f "$log"
    return 0
}

_deps_ensure_lab_tools || true
