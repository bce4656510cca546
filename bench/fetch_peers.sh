#!/usr/bin/env bash
# Download the peers' pure-Python wheels (Python 3.12, no dependencies) and unpack them into
# bench/.peers/site (git-ignored), so they travel with the tree to a GPU machine with no network;
# bench/gpu_check.py puts that folder first on sys.path.  Versions are pinned to the ones the
# adapters in bench/peers were written against (PEER_VERSIONS there).
#   fla-core        -> fla.ops.attnres.fused_attnres (flash-linear-attention's ops live here;
#                      the flash-linear-attention wheel itself only adds fla.layers/models)
#   liger-kernel    -> liger_kernel.transformers.functional.liger_attn_res
#   fast-attnres    -> attnres.attnres
#   flash-attn-res  -> flash_attn_res.phase_{1,2}_* triton ops
#   einops          -> needed by fla-core (the H200 image has it; harmless when it does)
# Usage: bench/fetch_peers.sh [python]   (default: python3; needs pip and network)
# The folder is git-ignored: a device run must carry it (the run tool's carry: ["bench/.peers"], ~13 MB).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py="${1:-python3}"
dest="$here/.peers"
rm -rf "$dest/site" "$dest/wheels"
mkdir -p "$dest/site" "$dest/wheels"
status=0
for spec in fla-core==0.6.0 liger-kernel==0.8.5 fast-attnres==2.1.0 flash-attn-res==0.1.12 einops; do
    if "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation py --abi none --platform any -d "$dest/wheels" "$spec"; then
        echo "resolved: $spec"
    else
        echo "FAILED:   $spec" >&2
        status=1
    fi
done
for whl in "$dest"/wheels/*.whl; do
    "$py" -m zipfile -e "$whl" "$dest/site"
done
ls "$dest/wheels"
exit $status
