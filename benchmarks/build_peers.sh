#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-bench, llama-server, llama-export-lora,
# llama-cvector-generator) from the SAME vendored llama.cpp source that the
# pinned llama-cpp-python binding was built from, so the peer numbers compare
# like with like (same ggml kernels, same graph code).
#
# Usage:  benchmarks/build_peers.sh            (peers go to $LORAMUX_PEERS, default <repo>/peers)
#         LORAMUX_PEERS=/some/dir benchmarks/build_peers.sh
#         LORAMUX_PEERS_JOBS=4 benchmarks/build_peers.sh   (parallel compile jobs, default 2)
#
# Idempotent: the sdist is downloaded/extracted only when missing and the
# build is skipped when all four binaries already exist.  Takes ~10 minutes on
# two cores.  Only PyPI is contacted (pip download of the sdist); the web UI
# prebuilt download is switched off so the build stays offline otherwise.
set -euo pipefail

BINDING_VERSION="0.3.36"
SDIST_NAME="llama_cpp_python-${BINDING_VERSION}"
TARGETS=(llama-server llama-bench llama-export-lora llama-cvector-generator)

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peers="${LORAMUX_PEERS:-${repo_root}/peers}"
jobs="${LORAMUX_PEERS_JOBS:-2}"
mkdir -p "${peers}"
peers="$(cd "${peers}" && pwd)"
src="${peers}/${SDIST_NAME}/vendor/llama.cpp"
build="${peers}/build"

all_built() {
    local t
    for t in "${TARGETS[@]}"; do
        [[ -x "${build}/bin/${t}" ]] || return 1
    done
}

if all_built; then
    echo "peers already built in ${build}/bin (delete it to rebuild)"
    exit 0
fi

# 1. The binding's sdist carries the exact llama.cpp tree it was built from.  Only the binding is
# forced to source: `--no-binary :all:` would also build pip's metadata backend deps from source
# (minutes, for nothing).
if [[ ! -f "${src}/CMakeLists.txt" ]]; then
    echo "fetching ${SDIST_NAME} sdist into ${peers}"
    python="${PYTHON:-python3}"
    "${python}" -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==${BINDING_VERSION}" -d "${peers}"
    archive="$(ls "${peers}"/llama_cpp_python-"${BINDING_VERSION}".tar.gz 2>/dev/null || true)"
    if [[ -z "${archive}" ]]; then
        echo "error: pip did not produce ${peers}/${SDIST_NAME}.tar.gz" >&2
        exit 1
    fi
    tar -xzf "${archive}" -C "${peers}"
fi
if [[ ! -f "${src}/CMakeLists.txt" ]]; then
    echo "error: ${src} has no CMakeLists.txt; remove ${peers}/${SDIST_NAME} and rerun" >&2
    exit 1
fi

# 2. Configure.  LLAMA_CURL is deprecated (ignored) in this llama.cpp version,
# so it is not passed; LLAMA_OPENSSL=OFF and LLAMA_USE_PREBUILT_UI=OFF keep
# the build from needing TLS or downloading the server's web UI.
cmake -S "${src}" -B "${build}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_UI=OFF

# 3. Build only the tools the benchmarks need.
cmake --build "${build}" -j "${jobs}" --target "${TARGETS[@]}"

if all_built; then
    echo "peers built: ${build}/bin"
else
    echo "error: build finished but some of ${TARGETS[*]} are missing in ${build}/bin" >&2
    exit 1
fi
