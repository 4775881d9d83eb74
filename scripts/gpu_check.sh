#!/usr/bin/env bash
# Every GPU measurement of docs/benchmarks.md's "One GPU" section in one run, about 8 minutes on one H100, for a
# session lent a device machine (`run` tool): it starts there in the repository root with $OUT to bring files back.
#   bash scripts/gpu_check.sh            # results under $OUT (default results/gpu_check)
# The device machine reaches no package index: what its Python lacks comes from wheels carried in $GPU_WHEELS
# (pip install --no-index --find-links). The checkout's folders are importable under their installed names
# (fedccrl_pipeline, fedccrl_serving, fedccrl_benchmarks) through links in a temporary folder, so nothing is built.
set -u
OUT=${OUT:-results/gpu_check}
mkdir -p "$OUT"
shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$PWD/pipeline" "$shim/fedccrl_pipeline"
ln -s "$PWD/serving" "$shim/fedccrl_serving"
ln -s "$PWD/benchmarks" "$shim/fedccrl_benchmarks"
export PYTHONPATH="$shim:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
if [ -n "${GPU_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --find-links "$GPU_WHEELS" "$GPU_WHEELS"/*.whl > "$OUT/pip.txt" 2>&1
fi

step() {  # step NAME SECONDS COMMAND...: its output and exit status in $OUT/NAME.txt, a line on stderr
  local name=$1 limit=$2
  shift 2
  echo "gpu_check: $name (at most ${limit}s): $*" >&2
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "exit status $?" >> "$OUT/$name.txt"
  tail -n 3 "$OUT/$name.txt" >&2
}

step device 30 bash -c "nvidia-smi; $PY -c 'import torch, platform; print(torch.__version__, torch.version.cuda, \
torch.cuda.get_device_name(), platform.python_version())'"
step tests 120 $PY -m pytest -q -m "" -p no:cacheprovider tests/test_static_batch.py tests/test_augment.py \
  tests/test_losses.py tests/test_bench.py -k "cuda or static or busy"
step dispatch 90 $PY -m fedccrl_benchmarks.cli dispatch --device cuda --size 224 --backbone mobilenet_v3_large \
  --batch-size 32 --images-per-client 128 --steps 20 --json "$OUT/dispatch.json"
step speed 240 $PY -m fedccrl_benchmarks.cli speed --device cuda --size 224 --backbone mobilenet_v3_large \
  --clients 6 --images-per-client 128 --steps 20 --repeats 1 --rounds 3 --workers 4 --json "$OUT/speed.json"
echo "gpu_check: done, results in $OUT" >&2
