#!/usr/bin/env bash
# Builds a SpecForge main package folder for
# //python/tests/specforge:specforge_main_test (DFLASH_SPECFORGE_MAIN): a
# copy of an installed specforge 0.2.0 with the files of SpecForge main
# that its DFlash-family models need copied over it. SpecForge main is not
# on PyPI; the user downloads those files from GitHub at the commit
# dflash.specforge.MAIN_COMMIT names, keeping their paths. This script
# holds no SpecForge code: it copies what it is given.
#
# Usage:
#   tools/specforge_main_overlay.sh OUT MAIN_FILES [PYTHON]
#     OUT         the folder to make (OUT/specforge; emptied first)
#     MAIN_FILES  a folder holding main's files under their repository
#                 paths (MAIN_FILES/specforge/...)
#     PYTHON      the interpreter whose specforge 0.2.0 is copied
#                 (default python3)
# Then:
#   tools/bazel test --test_env=DFLASH_TEST_PYTHON=PYTHON \
#     --test_env=DFLASH_SPECFORGE_MAIN=OUT \
#     //python/tests/specforge:specforge_main_test
set -euo pipefail

if [[ $# -lt 2 || $# -gt 3 ]]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi
out=$1
main_files=$2
python=${3:-python3}

# Main's files the model module imports beyond 0.2.0's.
needed=(
  specforge/algorithms/common/dflash_family_model.py
  specforge/algorithms/common/dflash_metrics.py
  specforge/core/chunking.py
  specforge/core/domino_loss.py
  specforge/modeling/draft/flex_attention_backend.py
  specforge/torch_compat.py
)
missing=()
for file in "${needed[@]}"; do
  [[ -f "$main_files/$file" ]] || missing+=("$file")
done
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "specforge_main_overlay: MAIN_FILES=$main_files lacks" \
    "${missing[*]} (download them from sgl-project/SpecForge at the" \
    "commit dflash.specforge.MAIN_COMMIT names, keeping their paths)" >&2
  exit 1
fi

installed=$("$python" - <<'EOF'
import importlib.metadata, importlib.util, os, sys
spec = importlib.util.find_spec("specforge")
if spec is None or not spec.submodule_search_locations:
    sys.exit("specforge_main_overlay: specforge is not installed for this "
             "python (pip install --no-deps specforge==0.2.0)")
version = importlib.metadata.version("specforge")
if version != "0.2.0":
    sys.exit(f"specforge_main_overlay: the installed specforge is {version}, "
             "expected 0.2.0")
print(list(spec.submodule_search_locations)[0])
EOF
)

rm -rf "$out"
mkdir -p "$out"
cp -r "$installed" "$out/specforge"
find "$out/specforge" -name __pycache__ -prune -exec rm -rf {} +
for file in "${needed[@]}"; do
  cp "$main_files/$file" "$out/$file"
done
echo "$out/specforge: specforge 0.2.0 from $installed with main's" \
  "${#needed[@]} files from $main_files"
