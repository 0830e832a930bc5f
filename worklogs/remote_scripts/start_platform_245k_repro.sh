#!/usr/bin/env bash
# Start the image on a GPU host exactly as the platform does: computility-run.yaml's `command`
# and `env`, verbatim (262,144-token context, -tp 4, fp16, ...), the real model read-only at
# /model. For reproducing start-up and long-context (~245K-token) behaviour off the platform.
#
#   worklogs/remote_scripts/start_platform_245k_repro.sh MODEL_DIR IMAGE
#   DRY_RUN=1 worklogs/remote_scripts/start_platform_245k_repro.sh MODEL_DIR IMAGE   # print only
#
# Prints the exact command it runs (shell-quoted, one line starting "+ "), waits for /health,
# tails the container log on failure (exit 1) and leaves the server running on success (it
# prints how to stop it).
#
# Environment:
#   ENGINE           docker | podman (default: docker if present, else podman)
#   YAML             the launch file (default: computility-run.yaml of this checkout)
#   GPU_ARGS         device flags (default docker: --gpus all; podman: --device
#                    nvidia.com/gpu=all, CDI: `nvidia-ctk cdi generate` must have run). Other
#                    accelerators (the platform's Iluvatar cards) need their vendor's flags here.
#   IPC_ARGS         default --ipc=host: vLLM's workers exchange tensors through /dev/shm (TP 4
#                    needs far more than the 64 MiB default; the platform's setting is not
#                    known, so this follows vLLM's container documentation)
#   NETWORK          publish (default: -p 127.0.0.1:HOST_PORT:<the YAML's --port>) | host
#   HOST_PORT        default 8000        NAME  container name (default vllm-platform-repro)
#   STARTUP_TIMEOUT  seconds to wait for /health (default 1800)
#   PYTHON           python3 with PyYAML to read the YAML (default python3; without PyYAML the
#                    image's own python reads it)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

if [ $# -ne 2 ]; then
  sed -n '2,12p' "$0" >&2
  exit 2
fi
MODEL_DIR=$1
IMAGE=$2
YAML=${YAML:-$repo/computility-run.yaml}
NAME=${NAME:-vllm-platform-repro}
HOST_PORT=${HOST_PORT:-8000}
NETWORK=${NETWORK:-publish}
STARTUP_TIMEOUT=${STARTUP_TIMEOUT:-1800}
PYTHON=${PYTHON:-python3}
DRY_RUN=${DRY_RUN:-0}

say() { echo "repro: $*" >&2; }

[ -f "$MODEL_DIR/config.json" ] || { say "$MODEL_DIR/config.json not found"; exit 2; }
[ -f "$YAML" ] || { say "$YAML not found"; exit 2; }
MODEL_DIR=$(cd "$MODEL_DIR" && pwd)
YAML=$(cd "$(dirname "$YAML")" && pwd)/$(basename "$YAML")

if [ -z "${ENGINE:-}" ]; then
  if command -v docker >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null 2>&1; then ENGINE=podman
  elif [ "$DRY_RUN" = 1 ]; then ENGINE=docker
  else say "neither docker nor podman found"; exit 2
  fi
fi
case $ENGINE in
  docker) default_gpu=(--gpus all) ;;
  podman) default_gpu=(--device nvidia.com/gpu=all) ;;
  *) say "ENGINE must be docker or podman"; exit 2 ;;
esac
if [ -n "${GPU_ARGS+set}" ]; then read -r -a gpu_args <<<"$GPU_ARGS"; else gpu_args=("${default_gpu[@]}"); fi
read -r -a ipc_args <<<"${IPC_ARGS:---ipc=host}"

# The YAML, checked like the platform's schema: E/NAME=VALUE and A/ARG fields, NUL-terminated.
PARSE='
import sys, yaml
raw = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
cmd, env = raw.get("command"), raw.get("env") or []
if not isinstance(cmd, list) or not cmd or not all(isinstance(a, str) for a in cmd):
    sys.exit("command must be a non-empty list of strings")
out = []
for item in env:
    if not isinstance(item, dict) or set(item) != {"name", "value"} or not isinstance(item["value"], str):
        sys.exit("env items must be {name, value} with string values: %r" % (item,))
    out += ["E", "%s=%s" % (item["name"], item["value"])]
for a in cmd:
    out += ["A", a]
sys.stdout.write("".join(f + "\0" for f in out))
'
if "$PYTHON" -c 'import yaml' >/dev/null 2>&1; then
  parse=("$PYTHON" -c "$PARSE" "$YAML")
elif [ "$DRY_RUN" != 1 ]; then
  parse=("$ENGINE" run --rm -v "$YAML:/run.yaml:ro" --entrypoint python3 "$IMAGE" -c "$PARSE" /run.yaml)
else
  say "DRY_RUN needs a python3 with PyYAML (PYTHON=...)"; exit 2
fi
env_args=()
cmd=()
while IFS= read -r -d '' kind && IFS= read -r -d '' value; do
  case $kind in
    E) env_args+=(-e "$value") ;;
    A) cmd+=("$value") ;;
  esac
done < <("${parse[@]}")
[ ${#cmd[@]} -gt 0 ] || { say "no command read from $YAML"; exit 1; }

# The server's port inside the container is the YAML's; nothing in the command changes.
yaml_port=8000
for ((i = 0; i < ${#cmd[@]} - 1; i++)); do
  [ "${cmd[i]}" = --port ] && yaml_port=${cmd[i + 1]}
done
case $NETWORK in
  publish) net_args=(-p "127.0.0.1:$HOST_PORT:$yaml_port") ;;
  host) net_args=(--network host); HOST_PORT=$yaml_port ;;
  *) say "NETWORK must be publish or host"; exit 2 ;;
esac

run=("$ENGINE" run -d --name "$NAME" "${gpu_args[@]}" "${ipc_args[@]}" "${net_args[@]}"
     -v "$MODEL_DIR:/model:ro" "${env_args[@]}" "$IMAGE" "${cmd[@]}")
printf '+'; printf ' %q' "${run[@]}"; printf '\n'
if [ "$DRY_RUN" = 1 ]; then
  exit 0
fi

if "$ENGINE" container inspect "$NAME" >/dev/null 2>&1; then
  say "a container named $NAME exists; remove it first: $ENGINE rm -f $NAME"
  exit 1
fi
log=${LOG:-$PWD/$NAME.log}
start=$(date +%s)
"${run[@]}" >/dev/null
fail() {
  say "$1"
  "$ENGINE" logs "$NAME" >"$log" 2>&1 || true
  say "last 200 log lines (full log: $log):"
  tail -n 200 "$log" >&2
  say "container left for inspection; remove with: $ENGINE rm -f $NAME"
  exit 1
}
while :; do
  elapsed=$(( $(date +%s) - start ))
  if [ "$("$ENGINE" inspect --format '{{.State.Running}}' "$NAME" 2>/dev/null)" != true ]; then
    fail "container exited ($("$ENGINE" inspect --format '{{.State.ExitCode}}' "$NAME" 2>/dev/null)) after ${elapsed} s, before /health"
  fi
  if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$HOST_PORT/health" 2>/dev/null; then
    break
  fi
  [ "$elapsed" -lt "$STARTUP_TIMEOUT" ] || fail "not healthy after ${STARTUP_TIMEOUT} s"
  sleep 5
done
say "healthy after $(( $(date +%s) - start )) s at http://127.0.0.1:$HOST_PORT"
curl -fsS "http://127.0.0.1:$HOST_PORT/v1/models" || true
echo
say "logs: $ENGINE logs -f $NAME    stop: $ENGINE rm -f $NAME"
