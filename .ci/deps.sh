# Sourced by examples/run.sh and tests/run.sh: installs what a fresh Debian 12 machine lacks
# (apt-get, once), then configures and builds into ./build. cmake is for the CMake package's
# consumer check (tests/consumer/check.sh); python3-torch is PyTorch's own TCPStore and torchrun,
# which the interoperability tests run against; libgloo-dev is gloo's headers, for libtorch's
# c10d::ProcessGroupGloo (meson's gloo_found, tests/test_dist_gloo.cpp in test_dist); libssl-dev
# is OpenSSL's libssl and libcrypto (TLS, HMAC-SHA256 and nonces of the authenticated handshakes);
# openssl is its command line, with which the TLS tests make their certificates. clang and
# libclang-rt-14-dev are the fuzz stage's (tests/fuzz/run.sh): clang++ -fsanitize=fuzzer and the
# libFuzzer runtime (libclang_rt.fuzzer-x86_64.a, which the g++-built targets link too).
distrpc_packages=(g++ meson ninja-build pkg-config cmake libtorch-dev libasio-dev libcereal-dev
                  doctest-dev python3-torch libgloo-dev libssl-dev openssl clang libclang-rt-14-dev)

distrpc_install_deps() {
  local missing=()
  for p in "${distrpc_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "== installing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq || return 1
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || return 1
}

# distrpc_build DIR [meson options...]: configure once, then build incrementally.
# The scripted builds keep line tables only (-g1: file:line in sanitizer reports and backtraces):
# full debug info of libtorch-heavy translation units costs about a third of the build time.
# Extra compiler flags go in DISTRPC_CPP_ARGS (space-separated, as Meson splits a -Dcpp_args value).
distrpc_configure() {
  local dir="$1"; shift
  if [ ! -f "$dir/build.ninja" ]; then
    meson setup "$dir" -Ddebug=false "-Dcpp_args=-g1${DISTRPC_CPP_ARGS:+ $DISTRPC_CPP_ARGS}" "$@" ||
      return 1
  fi
}

# distrpc_test_targets DIR: the ninja targets tests/run.sh needs from a configured build: every
# target under tests/, distrpc-run and the soak example (space-separated, relative to DIR).
distrpc_test_targets() {
  meson introspect --targets "$1" | python3 -c '
import json, os, sys
root = os.path.realpath(sys.argv[1])
for t in json.load(sys.stdin):
    for f in t["filename"]:
        rel = os.path.relpath(os.path.realpath(f), root)
        if rel.startswith("tests/") or rel in ("distrpc-run", "examples/soak"):
            print(rel)
' "$1" | tr '\n' ' '
}

distrpc_build() {
  local dir="$1"; shift
  distrpc_configure "$dir" "$@" || return 1
  # Two cores and ~1 GiB per libtorch translation unit: -j2 keeps memory and time predictable.
  # DISTRPC_TARGETS (space-separated) builds only those targets; DISTRPC_NINJA_ARGS adds ninja
  # options (tests/run_gpu.sh: -k 0, every error of a build against another libtorch at once).
  # shellcheck disable=SC2086
  ninja -C "$dir" -j "${DISTRPC_JOBS:-2}" ${DISTRPC_NINJA_ARGS:-} ${DISTRPC_TARGETS:-}
}
