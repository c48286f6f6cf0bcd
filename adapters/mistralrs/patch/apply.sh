#!/usr/bin/env bash
# Builds the patched mistralrs-core that a workspace takes with `[patch.crates-io]`.
#
#   adapters/mistralrs/patch/apply.sh [OUT_DIR] [--version 0.8.1]
#
# Takes the pristine mistralrs-core crate from the cargo registry (fetching it if needed), checks
# its sha256 against the crates.io checksum pinned below, adds src/powerinfer.rs and
# src/powerinfer/, applies
# mistralrs-core-<version>.patch and points the `powerinfer` dependency at this checkout's engine.
# OUT_DIR defaults to adapters/mistralrs/vendor/mistralrs-core; it is replaced unless it already
# holds exactly the patched crate (so that an unchanged patch does not trigger a rebuild).
set -euo pipefail

VERSION=0.8.1
# crates.io's checksum of mistralrs-core-0.8.1.crate (Cargo.lock `checksum`).
SHA256=a2b8b9e5c94491d9ceeded3a30291cb6af6ae74810a5776dd55e3bbb8b3429d4

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
engine=$(cd "$here/../../.." && pwd)
out="$(cd "$here/.." && pwd)/vendor/mistralrs-core"
while [ $# -gt 0 ]; do
    case "$1" in
        --version) want="$2"; shift 2 ;;
        --version=*) want="${1#--version=}"; shift ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) out="$1"; shift ;;
    esac
done
if [ "${want:-$VERSION}" != "$VERSION" ]; then
    echo "error: this patch set is for mistralrs-core $VERSION only, not ${want}." >&2
    echo "       Its hunks are checked against $VERSION's source; see adapters/mistralrs/README.md" >&2
    echo "       for what a port to another version touches." >&2
    exit 2
fi
[ -f "$engine/Cargo.toml" ] && grep -q '^name = "powerinfer"' "$engine/Cargo.toml" || {
    echo "error: $engine does not hold the powerinfer engine crate" >&2; exit 2; }

patch_file="$here/mistralrs-core-$VERSION.patch"

cargo_home="${CARGO_HOME:-$HOME/.cargo}"
find_crate() { ls "$cargo_home"/registry/cache/*/mistralrs-core-$VERSION.crate 2>/dev/null | head -1 || true; }
crate=$(find_crate)
if [ -z "$crate" ]; then
    echo "fetching mistralrs-core $VERSION from crates.io ..."
    tmp=$(mktemp -d)
    mkdir -p "$tmp/src" && touch "$tmp/src/lib.rs"
    printf '[package]\nname = "fetch-mistralrs-core"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\nmistralrs-core = "=%s"\n' \
        "$VERSION" > "$tmp/Cargo.toml"
    (cd "$tmp" && cargo fetch -q)
    rm -rf "$tmp"
    crate=$(find_crate)
    [ -n "$crate" ] || { echo "error: cargo fetch did not leave mistralrs-core-$VERSION.crate in $cargo_home/registry/cache" >&2; exit 1; }
fi
got=$(sha256sum "$crate" | cut -d' ' -f1)
if [ "$got" != "$SHA256" ]; then
    echo "error: $crate has sha256 $got, crates.io's mistralrs-core $VERSION has $SHA256" >&2
    exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$crate" -C "$work"
src="$work/mistralrs-core-$VERSION"
grep -q "^version = \"$VERSION\"" "$src/Cargo.toml" || {
    echo "error: $crate does not hold mistralrs-core $VERSION" >&2; exit 1; }
cp "$here/powerinfer.rs" "$src/src/powerinfer.rs"
cp -r "$here/powerinfer" "$src/src/powerinfer"
if ! patch -p1 --batch --forward --quiet -d "$src" < "$patch_file"; then
    echo "error: $(basename "$patch_file") does not apply to the pristine crate" >&2
    exit 1
fi
# The engine is not on crates.io yet: depend on this checkout by path (`|` as sed delimiter).
sed -i "s|@POWERINFER_PATH@|$engine|" "$src/Cargo.toml"
echo "mistralrs-core $VERSION + $(basename "$patch_file") + powerinfer.rs + powerinfer/" > "$src/.powerinfer-patch"
if [ -d "$out" ] && diff -rq "$src" "$out" > /dev/null 2>&1; then
    echo "mistralrs-core $VERSION with the powerinfer patch is up to date in $out"
    exit 0
fi
if [ -e "$out" ] && [ ! -f "$out/.powerinfer-patch" ]; then
    echo "error: $out exists and is not a patched crate written by this script; not replacing it" >&2
    exit 1
fi
rm -rf "$out"
mkdir -p "$(dirname "$out")"
mv "$src" "$out"
echo "patched mistralrs-core $VERSION written to $out"
