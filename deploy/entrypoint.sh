#!/usr/bin/env bash
# The container's entrypoint: `pagedllm serve`, configured by environment variables and by
# the container's arguments (appended as flags, so they win over the variables).
#
#   PAGEDLLM_MODEL                 a path (e.g. a mounted volume) or a Hugging Face hub id
#                                  (org/name), fetched into $PAGEDLLM_MODEL_DIR/org/name
#                                  with `hf download` (HF_TOKEN for gated models) unless a
#                                  path of that name exists
#   PAGEDLLM_MODEL_REVISION        hub branch, tag or commit (hub ids only)
#   PAGEDLLM_MODEL_INCLUDE         glob of the files to fetch, e.g. '*Q4_K_M.gguf' (hub ids only)
#   PAGEDLLM_MODEL_DIR             where hub models go (the image's default: /models)
#   PAGEDLLM_SERVED_MODEL_NAME     --served-model-name, space-separated (default: the hub id)
#   PAGEDLLM_TENSOR_PARALLEL_SIZE  --tensor-parallel-size
#   PAGEDLLM_MAX_MODEL_LEN         --max-model-len
#   PAGEDLLM_HOST, PAGEDLLM_PORT   --host, --port
#   PAGEDLLM_SHUTDOWN_TIMEOUT      --shutdown-timeout (drain seconds), if this pagedllm has it
#   PAGEDLLM_EXTRA_ARGS            more flags, split on whitespace
#   PAGEDLLM_API_KEY               read by the server itself
#
# A first argument that is not a flag is run as a command instead (e.g. `bash`).
set -euo pipefail

if [[ $# -gt 0 && $1 != -* ]]; then
    exec "$@"
fi

log() { echo "pagedllm-entrypoint: $*" >&2; }

# Flags given as arguments, so that a variable never adds the same flag a second time.
given=" $* "
has_flag() { [[ $given == *" $1 "* || $given == *" $1="* ]]; }

flags=()
model=${PAGEDLLM_MODEL:-}
served=${PAGEDLLM_SERVED_MODEL_NAME:-}

# org/name with no such path here: a hub id.
hub_id_re='^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$'
if [[ -n $model ]] && has_flag --model; then
    model=""  # an argument names the model
elif [[ -n $model && ! -e $model && $model =~ $hub_id_re ]]; then
    dest="${PAGEDLLM_MODEL_DIR:-/models}/$model"
    log "fetching $model${PAGEDLLM_MODEL_REVISION:+@$PAGEDLLM_MODEL_REVISION} into $dest"
    fetch=(hf download "$model" --local-dir "$dest")
    [[ -n ${PAGEDLLM_MODEL_REVISION:-} ]] && fetch+=(--revision "$PAGEDLLM_MODEL_REVISION")
    [[ -n ${PAGEDLLM_MODEL_INCLUDE:-} ]] && fetch+=(--include "$PAGEDLLM_MODEL_INCLUDE")
    # Progress goes to the log; stdout is the server's.
    "${fetch[@]}" >&2
    served=${served:-$model}
    model=$dest
fi

if [[ -n $model ]]; then
    flags+=(--model "$model")
fi
if [[ -n $served ]] && ! has_flag --served-model-name; then
    read -r -a names <<<"$served"
    flags+=(--served-model-name "${names[@]}")
fi

add() {  # add FLAG VALUE: the flag, unless it is empty or an argument already gives it
    if [[ -n $2 ]] && ! has_flag "$1"; then
        flags+=("$1" "$2")
    fi
}
add --tensor-parallel-size "${PAGEDLLM_TENSOR_PARALLEL_SIZE:-}"
add --max-model-len "${PAGEDLLM_MAX_MODEL_LEN:-}"
add --host "${PAGEDLLM_HOST:-}"
add --port "${PAGEDLLM_PORT:-}"

# --shutdown-timeout is newer than this script: pass it only to a server whose help lists
# it, so that a pagedllm without it still starts (and drains for its built-in time).
if [[ -n ${PAGEDLLM_SHUTDOWN_TIMEOUT:-} ]] && ! has_flag --shutdown-timeout; then
    usage=$(pagedllm serve --help 2>/dev/null || true)
    if [[ $usage == *--shutdown-timeout* ]]; then
        flags+=(--shutdown-timeout "$PAGEDLLM_SHUTDOWN_TIMEOUT")
    else
        log "this pagedllm has no --shutdown-timeout; ignoring PAGEDLLM_SHUTDOWN_TIMEOUT"
    fi
fi

if [[ -n ${PAGEDLLM_EXTRA_ARGS:-} ]]; then
    read -r -a extra <<<"$PAGEDLLM_EXTRA_ARGS"
    flags+=("${extra[@]}")
fi

exec pagedllm serve "${flags[@]}" "$@"
