#!/usr/bin/env bash
# vendor/glommio is glommio 0.9.0 as published on crates.io, less the paths in
# vendor/glommio.removed, plus vendor/glommio.patch (see vendor/glommio.md).
#
#   scripts/check_vendor.sh              check that vendor/glommio is exactly that
#   scripts/check_vendor.sh --regenerate rewrite vendor/glommio.patch from vendor/glommio
#   scripts/check_vendor.sh --self-test  check that the comparison catches one
#                                        changed byte and one extra file
#
# The crate is downloaded once into target/vendor-check (or taken from cargo's
# own download cache) and verified against the checksum crates.io publishes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

crate=glommio-0.9.0
url="https://static.crates.io/crates/glommio/$crate.crate"
# The "cksum" of glommio 0.9.0 in the crates.io index.
sha256=e1f8bc1fce949d18098dc0a4e861314e40351a0144ebf61e59bdb5254a2273b2
vendored=vendor/glommio
patch_file=vendor/glommio.patch
removed_list=vendor/glommio.removed
cache=$root/target/vendor-check

fail() {
  echo "check_vendor: $*" >&2
  exit 1
}

sha_ok() { echo "$sha256  $1" | sha256sum --check --status; }

# Puts the verified .crate file at $cache/$crate.crate.
fetch_crate() {
  local file=$cache/$crate.crate
  mkdir -p "$cache"
  if [ -f "$file" ] && sha_ok "$file"; then return; fi
  local cached
  for cached in "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$crate.crate"; do
    if [ -f "$cached" ] && sha_ok "$cached"; then
      cp "$cached" "$file"
      return
    fi
  done
  curl -fsSL --retry 3 -o "$file.part" "$url" || fail "cannot download $url"
  sha_ok "$file.part" || fail "$url does not have the sha256 crates.io publishes ($sha256)"
  mv "$file.part" "$file"
}

# Unpacks the crate into $1 (which must not exist) and removes the listed paths.
unpack_base() {
  local dest=$1 path
  fetch_crate
  rm -rf "$cache/unpack"
  mkdir -p "$cache/unpack"
  tar -xzf "$cache/$crate.crate" -C "$cache/unpack"
  mv "$cache/unpack/$crate" "$dest"
  while IFS= read -r path || [ -n "$path" ]; do
    [ -n "$path" ] || continue
    [ -e "$dest/$path" ] || fail "$removed_list names $path, which $crate does not have"
    rm -rf "${dest:?}/$path"
  done <"$root/$removed_list"
}

# Builds $cache/expected: the crate, less the listed paths, with the patch applied.
build_expected() {
  rm -rf "$cache/expected"
  unpack_base "$cache/expected"
  # The ceiling keeps git from taking kvferry's repository for the tree's own.
  GIT_CEILING_DIRECTORIES=$cache git -C "$cache/expected" apply --whitespace=nowarn \
    "$root/$patch_file" || fail "$patch_file does not apply to $crate less $removed_list"
}

# Compares an expected tree with an actual one, byte for byte.
compare() {
  local expected=$1 actual=$2
  if ! diff -r --no-dereference -q "$expected" "$actual" >"$cache/diff.txt" 2>&1; then
    echo "check_vendor: $actual is not $crate + $patch_file (less $removed_list):" >&2
    sed "s|$expected|<expected>|g" "$cache/diff.txt" >&2
    echo "After editing $vendored, run scripts/check_vendor.sh --regenerate and commit $patch_file." >&2
    return 1
  fi
}

check() {
  build_expected
  compare "$cache/expected" "$root/$vendored" || exit 1
  echo "check_vendor: $vendored is $crate + $patch_file (less $removed_list)"
}

# Writes the patch as a git diff of the base tree (a) against vendor/glommio (b),
# so both `git apply` and `patch -p1` take it.
regenerate() {
  rm -rf "$cache/regen"
  mkdir -p "$cache/regen"
  unpack_base "$cache/regen/a"
  cp -a "$root/$vendored" "$cache/regen/b"
  local rc=0
  (cd "$cache/regen" && GIT_CEILING_DIRECTORIES=$cache/regen git -c core.quotepath=off \
    diff --no-index --no-color --no-ext-diff --no-renames --no-prefix --full-index \
    --diff-algorithm=myers a b >"$root/$patch_file") || rc=$?
  [ "$rc" -le 1 ] || fail "git diff failed"
  echo "check_vendor: wrote $patch_file"
  check
}

# The comparison must fail on a copy with one byte changed, and on one with an
# extra file, and pass on an exact copy.
self_test() {
  build_expected
  local copy=$cache/self-test file=src/sys/uring.rs
  rm -rf "$copy"
  cp -a "$root/$vendored" "$copy"
  compare "$cache/expected" "$copy" || fail "self-test: an exact copy does not compare equal"

  local size offset byte
  size=$(stat -c %s "$copy/$file")
  offset=$((size / 2))
  byte=$(od -An -tu1 -j "$offset" -N1 "$copy/$file" | tr -d ' ')
  # shellcheck disable=SC2059 # the format is the octal escape being built
  printf "\\$(printf %03o $((byte ^ 1)))" |
    dd of="$copy/$file" bs=1 seek="$offset" count=1 conv=notrunc status=none
  if compare "$cache/expected" "$copy" 2>/dev/null; then
    fail "self-test: one byte changed in $file went unnoticed"
  fi
  cp "$cache/expected/$file" "$copy/$file"
  compare "$cache/expected" "$copy" || fail "self-test: restoring $file did not restore equality"

  touch "$copy/extra-file"
  if compare "$cache/expected" "$copy" 2>/dev/null; then
    fail "self-test: an extra file went unnoticed"
  fi
  rm -rf "$copy"
  echo "check_vendor: self-test passed (a changed byte and an extra file are caught)"
}

case "${1:-}" in
  "") check ;;
  --regenerate) regenerate ;;
  --self-test) self_test ;;
  *) fail "usage: $0 [--regenerate | --self-test]" ;;
esac
