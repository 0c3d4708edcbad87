# Sourced by the bench scripts: the build's binaries (first argument, default build), a scratch folder
# removed on exit, no progress bars, and `field NAME` to read a number from the GPT's JSON line on stdin.
BUILD=${1:-build}
X=$BUILD/bin/xlr8; G=$BUILD/bin/gpt
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export XLR8_PROGRESS=off
field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }
