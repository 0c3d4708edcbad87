#!/usr/bin/env bash
# `cpack -G DEB` makes xlr8_<version>_<arch>.deb; its control data names the Debian packages xlr8 needs.
# As root (CI), it is installed into the real system with apt-get, `xlr8 env` runs from /usr/bin in an
# empty directory with a minimal environment, the downstream project builds against /usr with no prefix
# and runs on 2 processes, and the package is removed again. Not root: the package is unpacked into a
# scratch root with dpkg-deb and the downstream project builds against that.
#   test_deb.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd) source=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/xlr8-deb.XXXXXX)
marker=/var/lib/xlr8-tests/installed-by-test
cleanup() {
  if [ -e "$marker" ]; then apt-get remove -y -qq xlr8 >/dev/null 2>&1 || dpkg -r xlr8 >/dev/null 2>&1 || true; rm -f "$marker"; fi
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$source/tests/package/common.sh"

(cd "$tmp" && cpack -G DEB --config "$(cd "$build" && pwd)/CPackConfig.cmake" -B "$tmp/pkg" >"$tmp/cpack.log" 2>&1) ||
  { cat "$tmp/cpack.log"; echo "FAIL: cpack"; exit 1; }
deb=$(ls "$tmp"/pkg/xlr8_*_"$(dpkg --print-architecture)".deb)
echo "package: $(basename "$deb")"
depends=$(dpkg-deb -f "$deb" Depends)
echo "Depends: $depends"
for p in libgloo-dev libyaml-cpp-dev nlohmann-json3-dev libfmt-dev zlib1g-dev libc6 libstdc++6; do
  grep -qw "$p" <<<"$depends" || { echo "FAIL: Depends lacks $p"; exit 1; }
done
# LibTorch: Debian's is a dependency; a wheel's (the default build's) is no Debian package, so the package
# must not claim one and names it in its description instead.
torch_lib=$(torch_library_of_build "$build")
description=$(dpkg-deb -f "$deb" Description)
echo "Description: $description"
if dpkg -S "$torch_lib" >/dev/null 2>&1; then
  grep -qw libtorch-dev <<<"$depends" || { echo "FAIL: built against Debian's LibTorch; Depends lacks libtorch-dev"; exit 1; }
else
  ! grep -qw libtorch-dev <<<"$depends" || { echo "FAIL: Depends names libtorch-dev, but $torch_lib is no Debian package's"; exit 1; }
  version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' "$(torch_config_dir_of_build "$build")/TorchConfigVersion.cmake")
  grep -q "LibTorch $version from $(dirname "$(dirname "$torch_lib")")" <<<"$description" ||
    { echo "FAIL: the description does not name LibTorch $version and where it is"; exit 1; }
fi
contents=$(dpkg-deb -c "$deb")
for f in ./usr/bin/xlr8 ./usr/libexec/xlr8/xlr8-full ./usr/include/xlr8/accelerator.hpp ./usr/lib/cmake/xlr8/xlr8Config.cmake \
         ./usr/lib/cmake/xlr8/xlr8Targets.cmake; do
  grep -q " $f\$" <<<"$contents" || { echo "FAIL: $f not in the package"; exit 1; }
done

if [ "$(id -u)" = 0 ] && [ "${XLR8_TEST_SYSTEM_INSTALL:-1}" != 0 ]; then
  if dpkg-query -W -f='${Status}' xlr8 2>/dev/null | grep -q "install ok installed" && [ ! -e "$marker" ]; then
    echo "FAIL: an xlr8 package is already installed on this system; remove it or set XLR8_TEST_SYSTEM_INSTALL=0"
    exit 1
  fi
  mkdir -p "$(dirname "$marker")" && touch "$marker"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$deb" >"$tmp/apt.log" 2>&1 ||
    { cat "$tmp/apt.log"; echo "FAIL: apt-get install"; exit 1; }
  mkdir "$tmp/empty"
  (cd "$tmp/empty" && env -i PATH=/usr/bin:/bin HOME="$tmp/empty" xlr8 env) || { echo "FAIL: xlr8 env"; exit 1; }
  build_and_run_downstream "$source" "$tmp/app" /usr/bin/xlr8
  apt-get remove -y -qq xlr8 >/dev/null 2>&1 && rm -f "$marker"
  [ ! -e /usr/bin/xlr8 ] || { echo "FAIL: /usr/bin/xlr8 left after removal"; exit 1; }
  echo "PASS (installed into this system with apt-get, then removed)"
else
  dpkg-deb -x "$deb" "$tmp/root"
  "$tmp/root/usr/bin/xlr8" env >/dev/null || { echo "FAIL: xlr8 env"; exit 1; }
  build_and_run_downstream "$source" "$tmp/app" "$tmp/root/usr/bin/xlr8" "$tmp/root/usr"
  echo "PASS (unpacked into a scratch root; run as root to test apt-get install)"
fi
