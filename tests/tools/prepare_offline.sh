#!/usr/bin/env bash
# Fills subprojects/asio, subprojects/cereal and subprojects/doctest with this machine's headers
# (Debian: libasio-dev, libcereal-dev, doctest-dev), in the layout of the Meson wraps there, so that
# a machine without them and without network (the GPU machine of tests/run_gpu.sh) can build:
# Meson uses a subproject's folder when it exists instead of fetching it. It also copies OpenSSL's
# headers (libssl-dev) to subprojects/openssl/include, which tests/run_gpu.sh uses only where the
# other machine has OpenSSL's libraries but not its headers, and, where a CUDA toolkit is installed,
# the CUDA runtime's headers to subprojects/cuda/include, which complete those of PyTorch's CUDA
# wheels (meson.build). The folders are ignored by git; carry them to the other machine with the
# tree (about 15 MB).
set -euo pipefail
inc=$(realpath "${1:-/usr/include}")
cd "$(dirname "$0")/../.."

for h in asio.hpp asio cereal doctest/doctest.h; do
  [ -e "$inc/$h" ] || { echo "prepare_offline: $inc/$h is missing (apt-get install libasio-dev libcereal-dev doctest-dev)"; exit 1; }
done

rm -rf subprojects/asio subprojects/cereal subprojects/doctest
mkdir -p subprojects/asio/asio/include subprojects/cereal/include subprojects/doctest/doctest
cp -r "$inc/asio" "$inc/asio.hpp" subprojects/asio/asio/include/
cp -r "$inc/cereal" subprojects/cereal/include/
cp "$inc/doctest/doctest.h" subprojects/doctest/doctest/
for p in asio cereal doctest; do
  cp "subprojects/packagefiles/$p/meson.build" "subprojects/$p/meson.build"
done

# OpenSSL: the headers, with the architecture's configuration headers beside them (Debian keeps
# those under /usr/include/<triplet>/openssl).
rm -rf subprojects/openssl
mkdir -p subprojects/openssl/include
[ -e "$inc/openssl/ssl.h" ] || { echo "prepare_offline: $inc/openssl/ssl.h is missing (apt-get install libssl-dev)"; exit 1; }
cp -r "$inc/openssl" subprojects/openssl/include/
triplet=$(gcc -print-multiarch 2>/dev/null || true)
if [ -n "$triplet" ] && [ -d "$inc/$triplet/openssl" ]; then
  cp -r "$inc/$triplet/openssl/." subprojects/openssl/include/openssl/
fi

# CUDA: the runtime's headers of this machine's toolkit (CUDA_HOME, else /usr/local/cuda), crt/
# with them. PyTorch's CUDA wheels ship cuda_runtime_api.h without the crt/ headers it includes
# (they come with nvcc); the build completes them from subprojects/cuda/include (meson.build).
# Keep the toolkit's major version the same as the other machine's PyTorch's.
cuda=$(realpath -m "${CUDA_HOME:-/usr/local/cuda}/include")
rm -rf subprojects/cuda
# Not a toolkit that shares the system's include folder (Debian's nvidia-cuda-toolkit, under
# /usr): its top-level headers there are every library's, and would shadow the system's.
if [ "$cuda" = /usr/include ]; then
  echo "prepare_offline: the CUDA headers in /usr/include are not copied (set CUDA_HOME to a toolkit of its own)"
elif [ -e "$cuda/cuda_runtime.h" ] && [ -d "$cuda/crt" ]; then
  mkdir -p subprojects/cuda/include
  cp -r "$cuda/crt" subprojects/cuda/include/
  [ -d "$cuda/nv" ] && cp -r "$cuda/nv" subprojects/cuda/include/  # cuda_fp16.h (nccl.h) includes <nv/target>
  find "$cuda/" -maxdepth 1 -type f \( -name '*.h' -o -name '*.hpp' \) \
    ! -name 'cudnn*' ! -name 'cublas*' ! -name 'cufft*' ! -name 'curand*' ! -name 'cusparse*' \
    ! -name 'cusolver*' ! -name 'cupti*' ! -name 'npp*' ! -name 'nvjpeg*' ! -name 'nccl*' \
    -exec cp {} subprojects/cuda/include/ \;
  echo "prepare_offline: CUDA runtime headers from $cuda ($(sed -nE 's/^#define CUDA_VERSION ([0-9]+).*/\1/p' "$cuda/cuda.h"))"
fi
for d in subprojects/asio subprojects/cereal subprojects/doctest subprojects/openssl subprojects/cuda; do
  if [ -d "$d" ]; then du -sh "$d" | sed 's/^/prepare_offline: /'; fi
done
