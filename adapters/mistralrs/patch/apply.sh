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
# crates.io's checksums of mistralrs-core-0.8.1.crate (Cargo.lock `checksum`) and of
# mistralrs-cli-0.8.1.crate (the registry index's `cksum`).
SHA256=a2b8b9e5c94491d9ceeded3a30291cb6af6ae74810a5776dd55e3bbb8b3429d4
CLI_SHA256=26bc2a0267ea22fa09eb61c6e78257f58d2704671c9666527ccb91a29275939c

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
engine=$(cd "$here/../../.." && pwd)
default_out="$(cd "$here/.." && pwd)/vendor/mistralrs-core"
out=$default_out
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
# pristine NAME SHA256: the path of crates.io's NAME-$VERSION.crate in cargo's cache (fetched if
# missing), after checking its sha256 against the pinned one.
pristine() {
    local name=$1 sha=$2 crate got tmp
    find_crate() { ls "$cargo_home"/registry/cache/*/"$name-$VERSION.crate" 2>/dev/null | head -1 || true; }
    crate=$(find_crate)
    if [ -z "$crate" ]; then
        echo "fetching $name $VERSION from crates.io ..." >&2
        tmp=$(mktemp -d)
        mkdir -p "$tmp/src" && touch "$tmp/src/lib.rs"
        if [ "$name" = mistralrs-cli ]; then
            # A binary crate cannot be a dependency; `cargo info` downloads it into the cache.
            (cd "$tmp" && cargo info -q "$name@$VERSION" > /dev/null)
        else
            printf '[package]\nname = "fetch-%s"\nversion = "0.0.0"\nedition = "2021"\n[dependencies]\n%s = "=%s"\n' \
                "$name" "$name" "$VERSION" > "$tmp/Cargo.toml"
            (cd "$tmp" && cargo fetch -q)
        fi
        rm -rf "$tmp"
        crate=$(find_crate)
        [ -n "$crate" ] || { echo "error: cargo did not leave $name-$VERSION.crate in $cargo_home/registry/cache" >&2; exit 1; }
    fi
    got=$(sha256sum "$crate" | cut -d' ' -f1)
    if [ "$got" != "$sha" ]; then
        echo "error: $crate has sha256 $got, crates.io's $name $VERSION has $sha" >&2
        exit 1
    fi
    echo "$crate"
}

# place SRC OUT WHAT: moves the crate written in SRC to OUT unless OUT already holds exactly it.
place() {
    local src=$1 out=$2 what=$3
    if [ -d "$out" ] && diff -rq "$src" "$out" > /dev/null 2>&1; then
        echo "$what is up to date in $out"
        return
    fi
    if [ -e "$out" ] && [ ! -f "$out/.powerinfer-patch" ]; then
        echo "error: $out exists and is not a crate written by this script; not replacing it" >&2
        exit 1
    fi
    rm -rf "$out"
    mkdir -p "$(dirname "$out")"
    mv "$src" "$out"
    echo "$what written to $out"
}

crate=$(pristine mistralrs-core "$SHA256")
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
place "$src" "$out" "patched mistralrs-core $VERSION"

# mistral.rs's own CLI and server (`mistralrs run`, `mistralrs serve`), next to the default core
# only: the example's workspace builds it as a member, so the two share one build of the core.
# Two edits to its Cargo.toml: the core's `powerinfer` feature on, and mistralrs-server-core
# without its default `swagger-ui` feature (whose build script downloads the UI from GitHub).
[ "$out" = "$default_out" ] || exit 0
cli=$(pristine mistralrs-cli "$CLI_SHA256")
tar -xzf "$cli" -C "$work"
src="$work/mistralrs-cli-$VERSION"
awk '
    { print }
    $0 == "[dependencies.mistralrs-core]" { print "features = [\"powerinfer\"]"; core++ }
    $0 == "[dependencies.mistralrs-server-core]" { print "default-features = false"; server++ }
    END { exit !(core == 1 && server == 1) }
' "$src/Cargo.toml" > "$src/Cargo.toml.new" || {
    echo "error: mistralrs-cli $VERSION's Cargo.toml does not name mistralrs-core and mistralrs-server-core once each" >&2
    exit 1; }
mv "$src/Cargo.toml.new" "$src/Cargo.toml"
# The workspace's Cargo.lock is the one that counts.
rm -f "$src/Cargo.lock"
echo "mistralrs-cli $VERSION + features = [\"powerinfer\"] on mistralrs-core" > "$src/.powerinfer-patch"
place "$src" "$(dirname "$out")/mistralrs-cli" "mistralrs-cli $VERSION with the powerinfer feature"
