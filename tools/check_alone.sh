#!/usr/bin/env bash
# One package as a user gets it: installed from its wheel (the actor with its two tidal dependencies) into a fresh
# venv outside the workspace (no workspace sources, no editable installs; third-party versions held to uv.lock's, so
# uv's cache serves them), checked to lack the heavy stacks it must not need, then its README example run
# (tools/readme_examples.py) and its own fast tests (`-m "not slow"`) run against the installed wheel.
#
#   tools/check_alone.sh DIST PKG             # DIST: a folder holding `uv build --all-packages`' wheels
#   tools/check_alone.sh DIST PKG lowest      # the same at the lowest versions its dependencies allow
#
# `lowest` resolves the package's direct dependencies with uv's lowest-direct resolution (the lower bounds its
# pyproject.toml states are what it is tested with), holding only torch and megatron-core (and what they pin) to
# uv.lock's versions: torch's CUDA wheels are gigabytes per version, too much to fetch on every CI run, so torch's
# lower bound is the one bound of a light package not tested here (its reason is beside it in pyproject.toml).
#
# `.ci/run` runs it for all five packages; .github/workflows/ci.yml's `package` job for one each.
set -euo pipefail
cd "$(dirname "$0")/.."
dist=$(cd "$1" && pwd) pkg=$2 resolution=${3:-locked}
start=$(date +%s)
stamp() { echo "[alone $pkg +$(( $(date +%s) - start ))s] $*"; }

# Per package: what must not be installed, its tidal dependencies, and which of its tests are left to the workspace.
args=()
case $pkg in
  batching) forbidden=ray,sglang,megatron deps="" ;;
  ckpt) forbidden=ray,sglang deps="" ;;
  placement) forbidden=sglang,megatron,torch deps="" ;;
  # The Triton kernel tests (134 of the actor's 328 s of tests on the 2-core box at load 15: Triton's CPU interpreter)
  # run in the workspace, to keep the five packages within 5 minutes.
  actor) forbidden=ray,sglang deps="batching ckpt" args=(-k "not triton") ;;
  # The tests on the SGLang servers of the test session (the shared one, the LoRA one) run in the workspace: here the
  # example's server is the only one brought up (two tests still start a server that must fail at once).
  rollout) forbidden=ray,megatron deps=""
    args=(-p pytest_without_fixtures --without-fixture _sglang_engine --without-fixture lora_server) ;;
  *) echo "check_alone: unknown package '$pkg': give one of batching ckpt placement actor rollout" >&2; exit 2 ;;
esac

wheels=()
for dep in "$pkg" $deps; do
  found=("$dist"/tidal_"$dep"-*.whl)
  [ -f "${found[0]}" ] || { echo "check_alone: no tidal_$dep wheel in $dist: run uv build --all-packages" >&2; exit 2; }
  wheels+=("${found[@]}")
done
venv=$(mktemp -d "${TMPDIR:-/tmp}/tidal-alone-$pkg.XXXXXX")
trap 'rm -rf "$venv"' EXIT
stamp "tidal-$pkg alone from ${wheels[*]##*/} (must lack: $forbidden)"
uv venv --quiet --python 3.12 "$venv"
uv export --locked --quiet --package "tidal-$pkg" --no-emit-workspace --no-hashes -o "$venv/constraints.txt"
uv export --locked --quiet --package "tidal-$pkg" --only-dev --no-emit-workspace --no-hashes -o "$venv/dev.txt"
# Bytecode only where an SGLang server starts (about half its start-up, bench/RESULTS.md); elsewhere compiling would
# cost more than it saves.
compile=()
[ "$pkg" = rollout ] && compile=(--compile-bytecode)
pins=(-c "$venv/constraints.txt")
if [ "$resolution" = lowest ]; then
  grep -E '^(torch|megatron-core|nvidia-|triton|cuda-)' "$venv/constraints.txt" > "$venv/heavy.txt" || true
  # the wheel's own requirements as top-level ones: lowest-direct lowers only those
  "$venv/bin/python" - "${wheels[0]}" > "$venv/direct.txt" <<'PY'
import email, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
print("\n".join(r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r and not r.startswith("tidal-")))
PY
  pins=(-c "$venv/heavy.txt" --resolution lowest-direct -r "$venv/direct.txt")
elif [ "$resolution" != locked ]; then
  echo "check_alone: unknown resolution '$resolution': give lowest, or nothing for uv.lock's versions" >&2; exit 2
fi
VIRTUAL_ENV="$venv" uv pip install --quiet "${compile[@]}" "${pins[@]}" -r "$venv/dev.txt" "${wheels[@]}"
if [ "$resolution" = lowest ]; then
  names=$(sed -E 's/[ <>=!~;[].*//' "$venv/direct.txt" | paste -sd'|')
  stamp "lowest direct dependencies: $(VIRTUAL_ENV="$venv" uv pip freeze | grep -iE "^($names)==" | paste -sd' ')"
fi
(cd "$venv" && "$venv/bin/python" - "$pkg" "$forbidden" "$venv" <<'PY'
import importlib, importlib.metadata, importlib.util, sys
pkg, forbidden, venv = sys.argv[1:]
module = importlib.import_module(f"tidal.{pkg}")
assert module.__file__.startswith(venv), f"tidal.{pkg} was imported from {module.__file__}, not from its wheel"
present = [m for m in forbidden.split(",") if importlib.util.find_spec(m) is not None]
assert not present, f"installed alone, tidal-{pkg} still pulled in {present}"
assert module.__version__ == importlib.metadata.version(f"tidal-{pkg}")
print(f"tidal-{pkg} {module.__version__} from {module.__file__}")
PY
)
stamp "README example"
"$venv/bin/python" tools/readme_examples.py run "$pkg" --python "$venv/bin/python" --timeout 900
# The repo's tests of this package, importing tidal.$pkg from the venv (import-mode=importlib puts no source on
# sys.path); the root conftest.py and pytest settings apply as in the workspace; tools/ holds the rollout's plugin.
stamp "fast tests"
PYTHONPATH="$PWD/tools" "$venv/bin/pytest" -q -p no:cacheprovider -m "not slow" "${args[@]}" "packages/$pkg"
stamp "done"
