#!/usr/bin/env bash
# Steps of tools/gpu.sh on several trees in one call, one after another on the same machine,
# so that a change is timed beside the code before it, on the same GPU in the same call. Each tree is a folder variants/NAME of this checkout, made before the call,
#     mkdir -p variants/before && git archive main nanoandrea tools tests pyproject.toml \
#         | tar -x -C variants/before
# (the package, the tools and the tests are what a step needs, ~3 MB; not ignored by git, the
# folder travels with the call as untracked files: remove it after). "here" is the checkout
# itself. Each runs with its own kernel cache; every log a step writes is appended to
# $OUT/variants.log under the tree's name, so that the few files a call brings back hold them
# all.
#   usage: bash tools/variants.sh "STEP..." NAME...      e.g. bash tools/variants.sh products here before
set -uo pipefail
steps=$1; shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
root=$PWD
for name in "$@"; do
  tree=$root; [ "$name" = here ] || tree=$root/variants/$name
  [ -d "$tree/nanoandrea" ] || { echo "variants: no tree $tree"; continue; }
  out=/tmp/variant-out/$name
  rm -rf "$out"; mkdir -p "$out"
  echo "=== variant $name ($(date +%H:%M:%S))" | tee -a "$OUT/variants.log"
  # (a variant's tree has no .whl of its own: it is given the checkout's)
  if [ ! -e "$tree/.whl" ] && [ -d "$root/.whl" ]; then ln -s "$root/.whl" "$tree/.whl"; fi
  (cd "$tree" && OUT=$out NANOANDREA_CACHE=/tmp/nanoandrea-cache-$name bash tools/gpu.sh $steps)
  for f in "$out"/*; do
    [ -f "$f" ] || continue
    echo "--- $name: ${f##*/}" >> "$OUT/variants.log"
    cat "$f" >> "$OUT/variants.log"
  done
done
