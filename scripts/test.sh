#!/usr/bin/env bash
# The whole softverbs test suite, in one command:
#   1. build every target of the workspace once (libraries, binaries, tests, examples),
#   2. run every test (unit, integration and doc tests) on that build,
#   3. smoke-check the `softverbs` CLI: pingpong over RC, UC and UD, and devinfo.
# Every command is printed before it runs; the first failure stops the script (non-zero exit).
# With CI=true, anything missing that the suite needs is a hard, loudly reported error.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

ci=false
if [[ "${CI:-}" == "true" ]]; then
    ci=true
fi

# Prints a command, then runs it.
run() {
    printf '\n+ %s\n' "$*"
    "$@"
}

# Stops the script because TOOL is missing.
missing() {
    local tool=$1 hint=$2
    if $ci; then
        local rule="========================================================================"
        printf '%s\nscripts/test.sh: FATAL (CI=true): `%s` is required but was not found.\n%s\n%s\n' \
            "$rule" "$tool" "$hint" "$rule" >&2
    else
        printf 'scripts/test.sh: `%s` not found. %s\n' "$tool" "$hint" >&2
    fi
    exit 1
}

# --- Required tools ------------------------------------------------------------------------
if ! command -v cargo >/dev/null 2>&1; then
    if [[ -x "${CARGO_HOME:-$HOME/.cargo}/bin/cargo" ]]; then
        PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
    else
        missing cargo "Install the Rust toolchain (https://rustup.rs), version 1.85 or newer."
    fi
fi

# --- System packages: real clients and independent oracles ---------------------------------
# ibverbs-utils (ibv_devices, ibv_devinfo, ibv_*_pingpong) and perftest (ib_write_lat, ...),
# run over the drop-in libibverbs.so.1; libibverbs-dev (verbs.h, for the struct-layout test);
# python3-scapy (its RoCE layer computes the ICRC independently of ours); tshark (Wireshark's
# RoCEv2 dissector reads the captures); iputils-ping (the network-namespace tests); the
# middleware of tests/middleware.rs: ucx-utils (ucx_info, ucx_perftest), qperf, openmpi-bin
# and libopenmpi-dev (mpirun, mpicc); the connection-manager programs of tests/rdmacm_tools.rs
# and rsocket_tools.rs: rdmacm-utils (rping, ucmatose, rstream, ...), libfabric-bin (fi_info,
# fi_pingpong) and librdmacm-dev (rdma_cma.h, for tests/c/cm_events.c); valgrind (a
# pingpong through the drop-in under memcheck). Installed from
# Debian when running as root; without
# them those tests are skipped, except under CI=true, where this stops here.
packages=(ibverbs-utils perftest libibverbs-dev python3-scapy tshark iputils-ping
    ucx-utils qperf openmpi-bin libopenmpi-dev rdmacm-utils libfabric-bin librdmacm-dev valgrind)
rdma_tools=(ibv_devices ibv_devinfo ibv_rc_pingpong ib_write_lat tshark ping
    ucx_info ucx_perftest qperf mpirun mpicc rping ucmatose rstream fi_pingpong valgrind)
packages_missing() {
    local t
    for t in "${rdma_tools[@]}"; do
        command -v "$t" >/dev/null 2>&1 || return 0
    done
    [[ ! -f /usr/include/infiniband/verbs.h ]] || [[ ! -f /usr/include/rdma/rdma_cma.h ]] ||
        ! /usr/bin/python3 -c 'import scapy.contrib.roce' >/dev/null 2>&1
}
if packages_missing && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    run apt-get update -q || true
    # (tshark asks whether non-root users may capture; noninteractive answers no.)
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${packages[@]}" || true
fi
if packages_missing; then
    hint="Install them with: sudo apt-get install ${packages[*]}"
    if $ci; then
        missing "${rdma_tools[*]} / infiniband/verbs.h / python3 scapy" "$hint"
    fi
    printf 'scripts/test.sh: test packages missing; their tests will be skipped. %s\n' "$hint" >&2
fi

# --- UCX's device check ---------------------------------------------------------------------
# UCX lists an IB device only if /dev/infiniband/<dev_name> is a character device the user
# may read and write (it never opens it). softverbs devices have no character device, so
# softverbs0's node (uverbs0) is made a link to /dev/null, when running as root and the name
# is free (a real HCA's uverbs0 passes the check as it is). Without it the UCX tests are
# skipped, except under CI=true, where they fail.
ucx_node=/dev/infiniband/uverbs0
if [[ ! -e "$ucx_node" && "$(id -u)" == 0 ]]; then
    run mkdir -p /dev/infiniband
    run ln -s /dev/null "$ucx_node" || true
fi
if [[ ! -c "$ucx_node" ]]; then
    hint="As root: mkdir -p /dev/infiniband && ln -s /dev/null $ucx_node"
    if $ci; then
        missing "$ucx_node (a character device, for UCX)" "$hint"
    fi
    printf 'scripts/test.sh: %s missing; the UCX tests will be skipped. %s\n' "$ucx_node" "$hint" >&2
fi

# --- Build once, then test on that build ---------------------------------------------------
run cargo build --workspace --all-targets
run cargo test --workspace

# --- CLI smoke checks ----------------------------------------------------------------------
for transport in rc uc ud; do
    run cargo run -q -p softverbs-cli -- pingpong --loopback -n 2000 --transport "$transport"
done
run cargo run -q -p softverbs-cli -- devinfo -v

printf '\nscripts/test.sh: all steps passed\n'
