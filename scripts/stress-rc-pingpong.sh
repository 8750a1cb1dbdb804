#!/usr/bin/env bash
# Runs COUNT consecutive server/client pairs of rdma-core's `ibv_rc_pingpong` over the drop-in
# libibverbs.so.1 (release build), each pair on a fresh TCP port, and counts the pairs that
# hang (a side still running after LIMIT seconds, default 20; both are killed) or fail. A
# pair whose server finds its port taken is run again on the next port (and counted apart).
#
#   scripts/stress-rc-pingpong.sh COUNT [ibv_rc_pingpong options...]
#   scripts/stress-rc-pingpong.sh 300 -e -t -n 2000
#
# The first hung or failed pair's output is kept in $TMPDIR/stress-rc-pingpong.*; with
# KEEP_GOING=0 the script stops there. Exit status: 0 when every pair passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

count=${1:?usage: $0 COUNT [ibv_rc_pingpong options...]}
shift
limit=${LIMIT:-20}
command -v ibv_rc_pingpong >/dev/null || { echo "ibv_rc_pingpong not found (apt-get install ibverbs-utils)" >&2; exit 2; }
cargo build -q --release -p softverbs-cli -p softverbs-ibverbs || exit 2
sv=target/release/softverbs
out=$(mktemp -d "${TMPDIR:-/tmp}/stress-rc-pingpong.XXXXXX")
hangs=0 fails=0 busy=0
start=$(date +%s)
# Ports below the kernel's ephemeral range, so no client connection of this machine holds one.
next_port=$((10000 + $$ % 10000))
i=0
while (( i < count )); do
    port=$next_port
    next_port=$((10000 + (next_port - 10000 + 1) % 20000))
    timeout -s KILL "$limit" "$sv" run -- ibv_rc_pingpong -g 0 -p "$port" "$@" >"$out/server" 2>&1 &
    server=$!
    # The client retries its connection for a while, but not forever: give the server a start.
    sleep 0.05
    timeout -s KILL "$limit" "$sv" run -- ibv_rc_pingpong -g 0 -p "$port" "$@" localhost >"$out/client" 2>&1
    c=$?
    wait "$server"
    s=$?
    if grep -q "Couldn't listen" "$out/server"; then
        # Something else holds the port: not a pair that ran; try again on another.
        busy=$((busy + 1))
        continue
    fi
    i=$((i + 1))
    if [[ $c -ne 0 || $s -ne 0 ]]; then
        if [[ $c -eq 137 || $s -eq 137 ]]; then
            hangs=$((hangs + 1)); what=HANG
        else
            fails=$((fails + 1)); what=FAIL
        fi
        echo "pair $i: $what (client $c, server $s); output in $out/pair-$i.*"
        cp "$out/client" "$out/pair-$i.client"; cp "$out/server" "$out/pair-$i.server"
        [[ ${KEEP_GOING:-1} == 0 ]] && break
    fi
done
echo "ibv_rc_pingpong $*: $count pairs, $hangs hung, $fails failed, $(( $(date +%s) - start )) s ($busy ports were busy and retried)"
[[ $hangs -eq 0 && $fails -eq 0 ]]
