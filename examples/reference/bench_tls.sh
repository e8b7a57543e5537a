#!/usr/bin/env bash
# TLS against plain TCP, as docs/benchmarks.md ("TLS") quotes it: makes a CA and a certificate with
# the openssl command line in a temporary folder, then runs bench_rpc on tcp without and with
# --tls, ROUNDS times each (default 3), interleaved, one JSON line per run prefixed by its label.
# Run from anywhere; it builds bench_rpc into ./build of the repository.
set -euo pipefail
cd "$(dirname "$0")/../.."
source .ci/deps.sh
distrpc_install_deps >&2
DISTRPC_TARGETS="examples/bench_rpc" distrpc_build build >&2
rounds="${ROUNDS:-3}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
(
  cd "$dir"
  # shellcheck disable=SC2086
  openssl req -x509 $key -keyout ca.key -out ca.pem -days 2 -subj /CN=bench-ca
  # shellcheck disable=SC2086
  openssl req $key -keyout key.pem -out cert.csr -subj /CN=bench
  openssl x509 -req -in cert.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out cert.pem -days 2
) >/dev/null 2>&1
for ((i = 1; i <= rounds; i++)); do
  echo "plain $(build/examples/bench_rpc --transport tcp)"
  echo "tls   $(build/examples/bench_rpc --transport tcp --tls "$dir")"
done
