# Shared by the packaging tests: build the downstream project against an xlr8 installation and run it
# on 2 processes with that installation's own `xlr8 launch`.
#   build_and_run_downstream SOURCE_DIR WORK_DIR XLR8_BIN [CMAKE_PREFIX_PATH]
build_and_run_downstream() {
  local source=$1 work=$2 xlr8=$3 prefix=${4:-}
  rm -rf "$work" && cp -r "$source/tests/package/downstream" "$work"
  local configure=(cmake -S "$work" -B "$work/build" -DCMAKE_BUILD_TYPE=Release)
  command -v ninja >/dev/null && configure+=(-G Ninja)
  [ -n "$prefix" ] && configure+=("-DCMAKE_PREFIX_PATH=$prefix")
  "${configure[@]}" >"$work/configure.log" 2>&1 || { cat "$work/configure.log"; echo "FAIL: configure"; exit 1; }
  # The package under test, not another xlr8 installed elsewhere (/usr/local...).
  local found
  found=$(grep '^xlr8_DIR:' "$work/build/CMakeCache.txt" | cut -d= -f2-)
  echo "found xlr8 in $found"
  case "$found" in "${prefix:-/usr}"/*) ;; *) echo "FAIL: found xlr8 in $found, not under ${prefix:-/usr}"; exit 1 ;; esac
  cmake --build "$work/build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; echo "FAIL: build"; exit 1; }
  local out
  out=$(cd "$work" && "$xlr8" launch --num_processes 2 "$work/build/app" 2>&1) || { echo "$out"; echo "FAIL: run"; exit 1; }
  echo "$out"
  # Both ranks ran, and trained in lockstep: one checksum.
  [ "$(grep -c 'downstream rank [01] of 2' <<<"$out")" = 2 ] || { echo "FAIL: expected 2 ranks"; exit 1; }
  [ "$(grep -o 'checksum [-0-9.]*' <<<"$out" | sort -u | wc -l)" = 1 ] || { echo "FAIL: ranks differ"; exit 1; }
}

# The TorchConfig directory a build found (its cache names it), and the libtorch.so beside it.
#   torch_config_dir_of_build BUILD_DIR; torch_library_of_build BUILD_DIR
torch_config_dir_of_build() { grep '^Torch_DIR:' "$1/CMakeCache.txt" | cut -d= -f2-; }
torch_library_of_build() { readlink -f "$(torch_config_dir_of_build "$1")/../../../lib/libtorch.so"; }
