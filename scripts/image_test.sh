#!/usr/bin/env bash
# The platform line's image, built and started the way the platform does it (issue 46):
#   1. rootful podman, configured for this host            scripts/podman_setup.sh
#   2. the stand-in of the platform's base image             scripts/make_base_image.sh
#      (Python 3.10 at /usr/local, torch 2.1.2 + vLLM 0.6.3 at the CoreX paths; debootstrap +
#      podman import; reused while its inputs are unchanged)
#   3. podman build of the Dockerfile FROM it with the network off (--network=none: the
#      Dockerfile's own steps must need none), from a snapshot of the context (layer cache
#      reused when present); build time, image size and the kernels step's outcome are printed
#   4. build-failure tests: a broken overlay / tampered deployment must fail the build
#      (IMAGE_TESTS=1 pytest tests/image -m "image and not server")
#   5. smoke checks in a container with no network: Python 3.10, vLLM 0.6.3 and torch from the
#      CoreX path, our overlay imports, `patch_ops.sh verify` passes, the kernels report is there
#   6. IMAGE_SERVE=1 only (the full container test; off by default until the V0 model and API
#      serve the admission suite; PY must then be the stand-in venv's, scripts/container_launch.py): the container started with computility-run.yaml's command
#      and env plus the launcher's documented CPU overrides, the tiny model read-only at /model,
#      port 8000 published on 127.0.0.1 only, beside it a small one (4,096-token context, one
#      sequence, an API key) for the suite's small_server checks; every `server` test against
#      them (VLLM_BASE_URL, VLLM_SMALL_BASE_URL); containers always removed (logs in
#      build/image-test/)
# Everything measured goes to build/image-test/summary.txt.
#
# Environment (all optional):
#   IMAGE (localhost/vllm-qwen35:platform-test)  BASE_IMAGE (localhost/standin-corex-base:0.6.3)
#   PY (.venv/bin/python: runs the tests; .venv-v0's when there is no .venv)
#   PY_V0 (.venv-v0/bin/python: runs scripts/container_launch.py, which needs the image's vLLM
#   0.6.3 installed, for its CPU settings)
#   MODEL_DIR (build/tiny-model)  MAX_MODEL_LEN (empty: the YAML's)  PORT (a free one)
#   NETWORK (bridge: -p 127.0.0.1:PORT:8000, the YAML's host/port unchanged; host: --network
#   host with --host 127.0.0.1 --port PORT)  STARTUP_TIMEOUT (900)  PYTEST_ARGS (extra)
#   SHM_SIZE (2g: vLLM's engine needs /dev/shm even on CPU; podman's default is 64m, and the
#   YAML cannot say it: a runtime flag, like --gpus)  IMAGE_TEST_CONTAINER (a name)
#   SMALL_SERVER (1; 0: no small container)  VLLM_OVERRIDES_DEFAULT_MAX_TOKENS (256, as
#   tests/conftest.py)  SERVER_TESTS (tests: the paths step 6 collects, always with -m server)
#   SKIP_BUILD_TESTS=1 skips step 4 (local iteration only; CI runs everything)
#   IMAGE_BUILD_ONLY=1 stops after step 3 (CI builds the image while the unit tests run)
#   IMAGE_SERVE=1 runs step 6
set -euo pipefail

# Everything runs inside main, which bash reads whole before running: editing this file during a
# run (other engineers share the tree) cannot change what the run does.
main() {
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

IMAGE=${IMAGE:-localhost/vllm-qwen35:platform-test}
BASE_IMAGE=${BASE_IMAGE:-localhost/standin-corex-base:0.6.3}
MODEL_DIR=${MODEL_DIR:-build/tiny-model}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-}
NETWORK=${NETWORK:-bridge}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-900}
PY_V0=${PY_V0:-$repo/.venv-v0/bin/python}
if [ -z "${PY:-}" ]; then
  PY=$repo/.venv/bin/python
  [ -x "$PY" ] || PY=$PY_V0
fi
OUT=$repo/build/image-test
CONTAINER=${IMAGE_TEST_CONTAINER:-vllm-image-test-$$}
mkdir -p "$OUT"
summary=$OUT/summary.txt
: >"$summary"

say() { echo "image-test: $*" >&2; }
note() { echo "$*" | tee -a "$summary" >&2; }
now() { date +%s; }
t_all=$(now)

[ -x "$PY" ] || { say "$PY missing: run make setup (or set PY)"; exit 1; }

# --- 1. podman -------------------------------------------------------------------------------
say "step 1: podman"
bash scripts/podman_setup.sh | tee -a "$summary"

# --- 2. base image ---------------------------------------------------------------------------
say "step 2: base image $BASE_IMAGE"
t=$(now)
bash scripts/make_base_image.sh "$BASE_IMAGE" | tee -a "$summary"
note "base_image_s=$(( $(now) - t ))"

# --- 3. build --------------------------------------------------------------------------------
build_args=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
# The build-failure tests rebuild with exactly these arguments, so that the layer cache hits.
export IMAGE_BUILD_ARGS="${build_args[*]@Q}"
# Build from a snapshot of exactly what the Dockerfile reads: the whole run (build, build-failure
# tests, container checks) then sees one consistent tree even if the checkout changes meanwhile.
ctx=$OUT/context
"$PY" scripts/build_context.py "$ctx" >/dev/null
export IMAGE_BUILD_CONTEXT=$ctx
shopt -s nullglob
inputs=("$ctx"/build-inputs/kernels/*.whl)
shopt -u nullglob
[ ${#inputs[@]} -eq 0 ] || say "build-inputs/kernels holds ${inputs[*]##*/}: the image installs it"
say "step 3: podman build --network=none -t $IMAGE ${build_args[*]} $ctx"
t=$(now)
# --network=none: the Dockerfile's steps must need no network (the platform's build may have
# none); --pull=never: the base is local and no registry is reachable.
if ! podman build --pull=never --network=none --layers --force-rm -f "$ctx/Dockerfile" \
    -t "$IMAGE" "${build_args[@]}" "$ctx" 2>&1 | tee "$OUT/build.log"; then
  say "podman build FAILED (log: $OUT/build.log)"
  exit 1
fi
build_s=$(( $(now) - t ))
cached=$(grep -c -- '--> Using cache' "$OUT/build.log" || true)
steps=$(grep -c '^STEP ' "$OUT/build.log" || true)
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
base_size=$(podman image inspect --format '{{.Size}}' "$BASE_IMAGE")
note "image_build_s=$build_s (steps cached: $cached of $steps; --network=none)"
note "image_size_mib=$(( size / 1024 / 1024 )) ($IMAGE, $(podman image inspect --format '{{.Id}}' "$IMAGE" | cut -c1-12); base $(( base_size / 1024 / 1024 )) MiB, our layers $(( (size - base_size) / 1024 / 1024 )) MiB)"
note "kernels_step: $(podman run --rm --pull=never --network=none "$IMAGE" head -n 1 /workspace/kernels-build.txt)"
if [ "${IMAGE_BUILD_ONLY:-0}" = 1 ]; then
  note "IMAGE_BUILD_ONLY=1: image built; steps 4-6 are the next run's (its build hits this cache)"
  return 0
fi

status=0

# --- 4. build-failure tests --------------------------------------------------------------------
export IMAGE_TESTS=1 IMAGE_UNDER_TEST=$IMAGE
if [ "${SKIP_BUILD_TESTS:-0}" != 1 ]; then
  say "step 4: build-failure tests"
  t=$(now)
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  "$PY" -m pytest tests/image -m "image and not server" -ra -p no:cacheprovider ${PYTEST_ARGS:-} \
    2>&1 | tee "$OUT/pytest-build.log" || status=1
  note "build_tests_s=$(( $(now) - t )) result: $(tail -1 "$OUT/pytest-build.log")"
else
  note "build_tests: SKIPPED (SKIP_BUILD_TESTS=1)"
fi

# --- 5. smoke checks ---------------------------------------------------------------------------
# In a container of the image with no network: the interpreter, engine and torch the platform's
# command will get, our overlay importable from where it was deployed, and the deployment intact.
say "step 5: smoke checks in the image"
t=$(now)
smoke='import sys, torch, vllm, vllm_overrides, os
corex = "/usr/local/corex/lib64/python3/dist-packages/"
assert sys.version_info[:2] == (3, 10), sys.version
assert vllm.__version__.split("+")[0] == "0.6.3", vllm.__version__
assert torch.__version__.startswith("2.1"), torch.__version__
for mod in (torch, vllm, vllm_overrides):
    assert mod.__file__.startswith(corex), mod.__file__
assert os.path.isfile(os.environ["VO_KERNELS_BUILD_REPORT"])
print("smoke: python", sys.version.split()[0], "vllm", vllm.__version__, "torch",
      torch.__version__, "vllm_overrides", vllm_overrides.__version__)'
if podman run --rm --pull=never --network=none -w / "$IMAGE" python3 -c "$smoke" \
    >"$OUT/smoke.log" 2>&1 &&
  podman run --rm --pull=never --network=none -w / -e PYTHON=python3 "$IMAGE" \
    bash /workspace/patch_ops.sh verify >>"$OUT/smoke.log" 2>&1; then
  note "smoke_s=$(( $(now) - t )) result: $(grep '^smoke:' "$OUT/smoke.log"); verify: $(grep -c 'verify: OK' "$OUT/smoke.log") OK"
else
  cat "$OUT/smoke.log" >&2
  note "smoke: FAILED (log: $OUT/smoke.log)"
  status=1
fi

if [ "${IMAGE_SERVE:-0}" != 1 ]; then
  note "serve: not run (IMAGE_SERVE=1 runs the container from computility-run.yaml and the" \
    "server tests)"
  note "image_test_total_s=$(( $(now) - t_all )) status=$status"
  echo "===== image-test summary ($summary) ====="
  cat "$summary"
  return "$status"
fi
[ -f "$MODEL_DIR/config.json" ] || { say "$MODEL_DIR/config.json missing: run make model"; exit 1; }
[ -x "$PY_V0" ] || { say "$PY_V0 missing: run make setup-v0 first"; exit 1; }
MODEL_ABS=$(cd "$MODEL_DIR" && pwd)

# --- 6. the containers ------------------------------------------------------------------------
# The main one: the YAML's command and env with the launcher's CPU overrides. A second, small one
# (4,096-token context, one sequence, an API key) stands in for the suite's local small_server
# (tests/admission/conftest.py): the checks that fill a whole context or need a key. Both get the
# suite's test-only output budget VLLM_OVERRIDES_DEFAULT_MAX_TOKENS (tests/conftest.py sets it for
# its local servers: "no max_tokens" requests then end in seconds, not after 262K tokens on CPU).
test_env=(-e "VLLM_OVERRIDES_DEFAULT_MAX_TOKENS=${VLLM_OVERRIDES_DEFAULT_MAX_TOKENS:-256}")
SMALL_KEY=image-test-small-key
containers=()

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_container NAME PORT LAUNCHER-ARGS... [-- EXTRA VLLM ARGS]
start_container() {
  local name=$1 port=$2 kind value
  shift 2
  local largs=(--cpu --model /model "$@") net env_args=() cmd=()
  case $NETWORK in
    bridge) net=(-p "127.0.0.1:$port:8000") ;;  # the YAML's --host 0.0.0.0 --port 8000 stay
    host) net=(--network host); largs=(--host 127.0.0.1 --port "$port" "${largs[@]}") ;;
    *) say "NETWORK must be bridge or host"; exit 2 ;;
  esac
  while IFS= read -r -d '' kind && IFS= read -r -d '' value; do
    case $kind in
      E) env_args+=(-e "$value") ;;
      A) cmd+=("$value") ;;
    esac
  done < <("$PY_V0" scripts/container_launch.py --format nul "${largs[@]}")
  [ ${#cmd[@]} -gt 0 ] || { say "no command from the launcher"; exit 1; }
  local run=(podman run -d --name "$name" --pull=never "${net[@]}" --shm-size "${SHM_SIZE:-2g}"
             -v "$MODEL_ABS:/model:ro" "${env_args[@]}" "${test_env[@]}" "$IMAGE" "${cmd[@]}")
  say "step 6: ${run[*]@Q}"
  echo "${run[*]@Q}" >>"$OUT/run-command.txt"
  containers+=("$name")
  "${run[@]}" >/dev/null
}

# wait_healthy NAME PORT START: prints the seconds from START to healthy
wait_healthy() {
  local name=$1 port=$2 start=$3
  while [ $(( $(now) - start )) -lt "$STARTUP_TIMEOUT" ]; do
    if [ "$(podman inspect --format '{{.State.Running}}' "$name")" != true ]; then
      say "$name exited ($(podman inspect --format '{{.State.ExitCode}}' "$name")) before healthy:"
      podman logs --tail 80 "$name" >&2 || true
      exit 1
    fi
    if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$port/health" 2>/dev/null; then
      echo $(( $(now) - start ))
      return 0
    fi
    sleep 2
  done
  say "$name not healthy after $STARTUP_TIMEOUT s:"
  podman logs --tail 80 "$name" >&2 || true
  exit 1
}

# shellcheck disable=SC2317  # invoked by the EXIT trap
cleanup() {
  local rc=$? name
  for name in "${containers[@]}"; do
    if podman container exists "$name" 2>/dev/null; then
      podman logs "$name" >"$OUT/$name.log" 2>&1 || true
      podman rm -f -t 10 "$name" >/dev/null 2>&1 || true
      say "container $name removed (log: $OUT/$name.log)"
    fi
  done
  return "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

PORT=${PORT:-$(free_port)}
main_args=()
[ -n "$MAX_MODEL_LEN" ] && main_args+=(--max-model-len "$MAX_MODEL_LEN")
: >"$OUT/run-command.txt"
t=$(now)
start_container "$CONTAINER" "$PORT" "${main_args[@]}"
if [ "${SMALL_SERVER:-1}" = 1 ]; then
  SMALL_PORT=$(free_port)
  start_container "$CONTAINER-small" "$SMALL_PORT" --max-model-len 4096 \
    -- --max-num-seqs 1 --api-key "$SMALL_KEY"
fi
secs=$(wait_healthy "$CONTAINER" "$PORT" "$t") || exit 1
note "container_start_to_healthy_s=$secs"
if [ "${SMALL_SERVER:-1}" = 1 ]; then
  secs=$(wait_healthy "$CONTAINER-small" "$SMALL_PORT" "$t") || exit 1
  note "small_container_start_to_healthy_s=$secs (started with the main one)"
  export VLLM_SMALL_BASE_URL=http://127.0.0.1:$SMALL_PORT VLLM_SMALL_API_KEY=$SMALL_KEY
fi

# --- 6b. tests against the container ------------------------------------------------------------
say "step 6: pytest -m server against http://127.0.0.1:$PORT"
t=$(now)
# shellcheck disable=SC2086  # SERVER_TESTS and PYTEST_ARGS are lists of words
VLLM_BASE_URL=http://127.0.0.1:$PORT IMAGE_TEST_CONTAINER=$CONTAINER IMAGE_TEST_NETWORK=$NETWORK \
  "$PY" -m pytest ${SERVER_TESTS:-tests} -m server -ra -p no:cacheprovider --durations=15 \
  ${PYTEST_ARGS:-} \
  2>&1 | tee "$OUT/pytest-server.log" || status=1
note "server_tests_s=$(( $(now) - t )) result: $(tail -1 "$OUT/pytest-server.log")"

# --- summary ----------------------------------------------------------------------------------
note "image_test_total_s=$(( $(now) - t_all )) status=$status"
echo "===== image-test summary ($summary) ====="
cat "$summary"
return "$status"
}

main "$@"
exit $?
