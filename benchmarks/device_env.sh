# Sourced at the start of every device call: the project's dependencies the GPU image lacks (fastapi, uvicorn,
# pydantic, websockets, hydra, xxhash, gguf, ...) are wheels in .whl/ (carried: it is git-ignored), installed into
# /tmp/site. --find-links picks each package's wheel for this python (.whl/ holds cp311 and cp312 builds).
#   carry [".whl"], then: source benchmarks/device_env.sh && benchmarks/gpu_session.sh tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  --find-links .whl $(ls .whl | sed 's/-.*//' | sort -u) 2>&1 | grep -v -i 'warning' | tail -3
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
