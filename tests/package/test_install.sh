#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, then a separate project (tests/package/downstream) builds
# against it with find_package(xlr8) alone and runs on 2 processes with the installed `xlr8 launch`.
#   test_install.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd) source=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/xlr8-install.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
. "$source/tests/package/common.sh"

cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
prefix=$tmp/prefix
for f in bin/xlr8 libexec/xlr8/xlr8-full include/xlr8/accelerator.hpp include/xlr8/xlr8.hpp; do
  [ -e "$prefix/$f" ] || { echo "FAIL: $f not installed"; exit 1; }
done
config=$(find "$prefix" -name xlr8Config.cmake)
[ -n "$config" ] && [ -e "$(dirname "$config")/xlr8ConfigVersion.cmake" ] || { echo "FAIL: no CMake package"; exit 1; }
# Public headers only: exactly include/xlr8's files, and nothing from src/.
diff <(cd "$source/include/xlr8" && ls) <(cd "$prefix/include/xlr8" && ls) || { echo "FAIL: header set"; exit 1; }
[ "$(ls "$prefix/include")" = xlr8 ] || { echo "FAIL: more than include/xlr8 installed"; exit 1; }
# Nothing points back into the build or source tree, but for the LibTorch the package was built against (its
# Torch_DIR hint), which lives in the source tree when it is the project's .venv.
torch_prefix=$(dirname "$(dirname "$(torch_library_of_build "$build")")")
if sed "s|$torch_prefix||g" "$(dirname "$config")"/*.cmake | grep -e "$source" -e "$build"; then
  echo "FAIL: build paths leak"; exit 1
fi

"$prefix/bin/xlr8" --version
# Through a link elsewhere (as a PATH entry would be), the commands handed to libexec's xlr8-full still run.
ln -s "$prefix/bin/xlr8" "$tmp/xlr8-link"
"$tmp/xlr8-link" --version | grep -q "^xlr8 " || { echo "FAIL: --version through a link"; exit 1; }
"$tmp/xlr8-link" estimate-memory --params 1000 >/dev/null || { echo "FAIL: estimate-memory through a link"; exit 1; }
build_and_run_downstream "$source" "$tmp/app" "$prefix/bin/xlr8" "$prefix"
echo "PASS"
