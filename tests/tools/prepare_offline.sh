#!/usr/bin/env bash
# Fills subprojects/asio, subprojects/cereal and subprojects/doctest with this machine's headers
# (Debian: libasio-dev, libcereal-dev, doctest-dev), in the layout of the Meson wraps there, so that
# a machine without them and without network (the GPU machine of tests/run_gpu.sh) can build:
# Meson uses a subproject's folder when it exists instead of fetching it. The folders are ignored by
# git; carry them to the other machine with the tree (7.6 MB).
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
du -sh subprojects/asio subprojects/cereal subprojects/doctest | sed 's/^/prepare_offline: /'
