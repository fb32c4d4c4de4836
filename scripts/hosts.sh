#!/usr/bin/env bash
# Several "hosts" on one machine: a network namespace each, joined by one
# bridge in the root namespace, so a prefill engine, a decode engine and a
# router can each have their own address and link, and a test can slow a
# link down (tc tbf) or cut it. Needs root, ip (iproute2) and tc.
#
#   hosts.sh up NAME SUBNET_OCTET HOST...   namespaces NAME-HOST, addresses
#                                           10.OCTET.0.1.., the root
#                                           namespace at 10.OCTET.0.254
#   hosts.sh down NAME                      remove all of NAME (idempotent)
#   hosts.sh rate NAME HOST RATE|off        shape both directions of HOST's link
#   hosts.sh cut NAME HOST                  take HOST's link down
#   hosts.sh heal NAME HOST                 bring it back
#   hosts.sh clean                          remove harnesses whose creator died
#   hosts.sh check                          can namespaces be made here?
#
# NAME is short (interface names stop at 15 characters: NAME-br, NAME-i12)
# and has no '-', so "NAME-" never matches another harness's prefix.
# `up` records its creator (KVFERRY_HOSTS_OWNER, else the calling process)
# under /run/kvferry-hosts/NAME, and `clean` removes a harness once that
# process is gone: a test run killed with SIGKILL cannot leak one for long.
#
# Exit status of `up`: 3 when 10.OCTET.0.0/24 is already in use on this
# machine, 4 when NAME is, so a caller can pick another and retry.
set -euo pipefail

RUN=/run/kvferry-hosts
# Python's Hosts names harnesses kvf<creator pid in hex>n<counter>, so a
# harness whose state directory was lost still names its creator.
AUTO_NAME='^kvf([0-9a-f]+)n[0-9a-z]+$'

die() {
    echo "hosts.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

valid_name() {
    [[ $1 =~ ^[a-z][a-z0-9]{0,10}$ ]]
}

check_name() {
    valid_name "$1" || die "bad NAME '$1': 1 to 11 characters, [a-z][a-z0-9]*"
}

# The process's start time (clock ticks since boot) tells a live creator
# from an unrelated process that was later given the same pid.
start_time() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    # comm may hold spaces and parentheses: the fields after it start
    # after the last ") ".
    stat=${stat##*) }
    local -a f
    read -ra f <<<"$stat"
    echo "${f[19]}"
}

# Zombies still answer kill -0, but they hold no namespace any more.
alive() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat:0:1} != Z ]]
}

# Bridged traffic between two hosts passes the root namespace's iptables
# FORWARD chain when br_netfilter is loaded with bridge-nf-call-iptables=1
# (Docker loads it and sets FORWARD's policy to DROP). The bridge's own
# nf_call_iptables flag cannot turn that off: the kernel ORs it with the
# sysctl. So the bridge gets an ACCEPT rule of its own, the same one
# Docker gives docker0, removed again by `down`.
BRNF=/proc/sys/net/bridge/bridge-nf-call-iptables

iptables_accept() {
    local name=$1
    [[ -r $BRNF && $(cat "$BRNF") == 1 ]] || return 0
    command -v iptables >/dev/null || return 0
    iptables -w -C FORWARD -i "$name-br" -o "$name-br" -j ACCEPT 2>/dev/null \
        || iptables -w -I FORWARD 1 -i "$name-br" -o "$name-br" -j ACCEPT
}

iptables_forget() {
    local name=$1
    command -v iptables >/dev/null || return 0
    # One rule per `up`, but a crashed `up` may have been retried.
    while iptables -w -D FORWARD -i "$name-br" -o "$name-br" -j ACCEPT 2>/dev/null; do
        :
    done
}

namespaces_of() {
    ip netns list 2>/dev/null | awk -v p="$1-" 'index($1, p) == 1 { print $1 }'
}

links_of() {
    ip -o link show 2>/dev/null \
        | awk -F': ' -v p="$1-" '{ sub(/@.*/, "", $2) } index($2, p) == 1 { print $2 }'
}

# Anything routed to 10.OCTET.0.0/24 or inside it, other than a default
# route, means the subnet is taken here (by the machine's own network, or
# another harness's bridge).
subnet_taken() {
    local net="10.$1.0.0/24" routes
    routes=$(
        ip -4 route show table all match "$net"
        ip -4 route show table all root "$net"
    )
    grep -Eqv '^$|^([a-z]+ )?default( |$)' <<<"$routes"
}

cmd_down() {
    [[ $# -eq 1 ]] || usage
    local name=$1
    check_name "$name"
    local ns pid pids deadline
    for ns in $(namespaces_of "$name"); do
        # A process left inside would keep the namespace, and with it the
        # veth pair, alive after `ip netns delete`.
        pids=$(ip netns pids "$ns" 2>/dev/null || true)
        if [[ -n $pids ]]; then
            # shellcheck disable=SC2086
            kill -TERM $pids 2>/dev/null || true
            deadline=$((SECONDS + 3))
            for pid in $pids; do
                while alive "$pid" && ((SECONDS < deadline)); do
                    sleep 0.05
                done
                kill -KILL "$pid" 2>/dev/null || true
            done
        fi
        ip netns delete "$ns" 2>/dev/null || true
    done
    local link
    for link in $(links_of "$name"); do
        ip link delete "$link" 2>/dev/null || true
    done
    iptables_forget "$name"
    rm -rf "${RUN:?}/$name"
}

cmd_up() {
    [[ $# -ge 3 ]] || usage
    local name=$1 octet=$2
    shift 2
    local -a hosts=("$@")
    check_name "$name"
    if ! [[ $octet =~ ^[0-9]{1,3}$ ]] || ((octet < 1 || octet > 254)); then
        die "bad SUBNET_OCTET '$octet': 1 to 254"
    fi
    local n=${#hosts[@]}
    ((${#name} + 2 + ${#n} <= 15)) || die "NAME '$name' too long for $n hosts"
    ((n <= 253)) || die "at most 253 hosts"
    local h i j
    for ((i = 0; i < n; i++)); do
        h=${hosts[i]}
        [[ $h =~ ^[A-Za-z0-9_.]{1,40}$ ]] || die "bad HOST '$h': [A-Za-z0-9_.]{1,40}"
        for ((j = 0; j < i; j++)); do
            [[ ${hosts[j]} != "$h" ]] || die "HOST '$h' given twice"
        done
    done

    local owner=${KVFERRY_HOSTS_OWNER:-$PPID} started
    started=$(start_time "$owner") || die "owner process $owner not found"

    mkdir -p "$RUN"
    # Serializes the subnet and name checks with the creation that follows,
    # so two test runs starting together cannot pick the same subnet.
    exec 9>"$RUN/.lock"
    flock -w 60 9 || die "another hosts.sh up holds $RUN/.lock"

    if [[ -e $RUN/$name ]] || [[ -n $(namespaces_of "$name") ]] \
        || [[ -n $(links_of "$name") ]]; then
        echo "hosts.sh: NAME '$name' is in use" >&2
        exit 4
    fi
    if subnet_taken "$octet"; then
        echo "hosts.sh: 10.$octet.0.0/24 is in use here" >&2
        exit 3
    fi

    # The owner goes first, so that `clean` can remove a half-made harness
    # whose creator died while making it.
    local tmp
    tmp=$(mktemp -d "$RUN/.new.XXXXXX")
    echo "$owner $started" >"$tmp/owner"
    echo "$octet" >"$tmp/octet"
    printf '%s\n' "${hosts[@]}" >"$tmp/hosts"
    mv "$tmp" "$RUN/$name"

    # Half a harness is worse than none: undo it if any step fails.
    # shellcheck disable=SC2064  # $name is fixed now
    trap "cmd_down '$name'" EXIT

    local br=$name-br gw=10.$octet.0.254
    ip link add "$br" type bridge
    ip addr add "$gw/24" dev "$br"
    ip link set "$br" up
    iptables_accept "$name"

    local ns veth
    for ((i = 1; i <= n; i++)); do
        ns=$name-${hosts[i - 1]}
        veth=$name-i$i
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip -n "$ns" addr add "10.$octet.0.$i/24" dev eth0
        ip -n "$ns" link set lo up
        ip -n "$ns" link set eth0 up
        # Programs learn their outbound address by a UDP connect to a
        # public address; that needs a route there, and the gateway gives
        # one even though nothing is forwarded beyond it.
        ip -n "$ns" route add default via "$gw" dev eth0
        ip link set "$veth" master "$br"
        ip link set "$veth" up
    done
    trap - EXIT
    flock -u 9
    echo "$name 10.$octet.0.0/24 ${hosts[*]}"
}

# Sets $veth, $ns and $gw for HOST of harness NAME.
host_link() {
    local name=$1 host=$2
    check_name "$name"
    [[ -d $RUN/$name ]] || die "no harness '$name'"
    local i
    i=$(awk -v h="$host" '$0 == h { print NR; exit }' "$RUN/$name/hosts")
    [[ -n $i ]] || die "no host '$host' in harness '$name'"
    veth=$name-i$i
    ns=$name-$host
    gw=10.$(cat "$RUN/$name/octet").0.254
}

# tc's rate units (a bare number is bits per second), as bytes per second.
rate_bytes() {
    awk -v r="$1" 'BEGIN {
        if (!match(r, /^[0-9]+(\.[0-9]+)?/)) exit 1
        n = substr(r, 1, RLENGTH); u = tolower(substr(r, RLENGTH + 1))
        split("bit kbit mbit gbit tbit", bit, " ")
        split("bps kbps mbps gbps tbps", byt, " ")
        split("bit kibit mibit gibit tibit", ibit, " ")
        split("bps kibps mibps gibps tibps", ibyt, " ")
        if (u == "") u = "bit"
        for (k = 1; k <= 5; k++) {
            if (u == bit[k]) m = 1000 ^ (k - 1) / 8
            else if (u == byt[k]) m = 1000 ^ (k - 1)
            else if (u == ibit[k]) m = 1024 ^ (k - 1) / 8
            else if (u == ibyt[k]) m = 1024 ^ (k - 1)
        }
        if (!m || n <= 0) exit 1
        printf "%.0f\n", n * m
    }'
}

cmd_rate() {
    [[ $# -eq 3 ]] || usage
    local veth ns gw
    host_link "$1" "$2"
    local rate=$3
    if [[ $rate == off ]]; then
        tc qdisc del dev "$veth" root 2>/dev/null || true
        ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
        return
    fi
    local bytes
    bytes=$(rate_bytes "$rate") || die "bad RATE '$rate' (e.g. 250mbit, 10gbit, off)"
    # The bucket must hold at least one timer tick's worth (rate/HZ) or tbf
    # falls short of the rate at high rates; 10 ms of traffic covers HZ down
    # to 100. The 64 KiB floor lets a whole GSO packet through unsplit.
    local burst=$((bytes / 100))
    ((burst >= 65536)) || burst=65536
    tc qdisc replace dev "$veth" root tbf rate "$rate" burst "$burst" latency 50ms
    ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
}

cmd_cut() {
    [[ $# -eq 2 ]] || usage
    local veth ns gw
    host_link "$1" "$2"
    ip link set "$veth" down
}

cmd_heal() {
    [[ $# -eq 2 ]] || usage
    local veth ns gw
    host_link "$1" "$2"
    ip link set "$veth" up
    # The peer's carrier comes back asynchronously; callers expect a healed
    # link to carry traffic as soon as this returns.
    local deadline=$((SECONDS + 5))
    until [[ $(ip -n "$ns" -o link show dev eth0) == *LOWER_UP* ]]; do
        ((SECONDS < deadline)) || die "eth0 in $ns has no carrier after heal"
        sleep 0.02
    done
    # Routes outlive a carrier loss but not an administrative down, which
    # someone may have done by hand inside the namespace.
    if [[ -z $(ip -n "$ns" route show default) ]]; then
        ip -n "$ns" link set eth0 up
        ip -n "$ns" route replace default via "$gw" dev eth0
    fi
}

cmd_clean() {
    [[ $# -eq 0 ]] || usage
    local -A seen=()
    local name d
    for d in "$RUN"/*/; do
        [[ -d $d ]] || continue
        name=$(basename "$d")
        valid_name "$name" && seen[$name]=1
    done
    # Harnesses with no state directory left: only those whose name says
    # who made them.
    local x
    for x in $(ip netns list 2>/dev/null | awk '{ print $1 }') \
        $(ip -o link show 2>/dev/null | awk -F': ' '{ sub(/@.*/, "", $2); print $2 }'); do
        name=${x%%-*}
        [[ $x == *-* && $name =~ $AUTO_NAME ]] && seen[$name]=1
    done
    local pid started
    for name in "${!seen[@]}"; do
        if [[ -r $RUN/$name/owner ]]; then
            read -r pid started <"$RUN/$name/owner" || true
            [[ -n ${pid:-} && $(start_time "$pid" 2>/dev/null || true) == "${started:-}" ]] && continue
        elif [[ $name =~ $AUTO_NAME ]]; then
            pid=$((16#${BASH_REMATCH[1]}))
            [[ -d /proc/$pid ]] && continue
        else
            continue
        fi
        echo "hosts.sh: removing $name (its creator is gone)" >&2
        cmd_down "$name"
    done
    # Leftovers of an `up` killed between mktemp and mv.
    find "$RUN" -maxdepth 1 -name '.new.*' -mmin +1 -exec rm -rf {} + 2>/dev/null || true
}

cmd_check() {
    [[ $# -eq 0 ]] || usage
    local why=""
    if ((EUID != 0)); then
        why="not root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    elif ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
        why="ip and tc (iproute2) are needed"
    elif ! command -v flock >/dev/null; then
        why="flock (util-linux) is needed"
    else
        # Everything `up` and `rate` need, on a throwaway namespace.
        local ns=kvfchk$$ v=kvfc$$ err
        if ! err=$({
            ip netns add "$ns" &&
                ip link add "${v}a" type veth peer name "${v}b" &&
                ip link set "${v}b" netns "$ns" &&
                ip link add "${v}r" type bridge &&
                ip link set "${v}a" master "${v}r" &&
                tc qdisc replace dev "${v}a" root tbf rate 1mbit burst 65536 latency 50ms
        } 2>&1); then
            why="cannot make a namespace, veth, bridge or tbf here: ${err//$'\n'/; }"
        fi
        ip link delete "${v}a" 2>/dev/null || true
        ip link delete "${v}r" 2>/dev/null || true
        ip netns delete "$ns" 2>/dev/null || true
    fi
    if [[ -n $why ]]; then
        echo "SKIPPED: $why"
        exit 1
    fi
}

[[ $# -ge 1 ]] || usage
cmd=$1
shift
case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    rate) cmd_rate "$@" ;;
    cut) cmd_cut "$@" ;;
    heal) cmd_heal "$@" ;;
    clean) cmd_clean "$@" ;;
    check) cmd_check "$@" ;;
    *) usage ;;
esac
