#!/usr/bin/env bash
# Runs every test of the workspace, or of the crates named (`-p tidemark-sqlite`).
# Provisions a nats-server >= 2.10 into the git-ignored .tools/ folder first (no root
# needed), because the NATS tests start real servers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/provision-nats.sh
# With no arguments, every crate; with arguments (`-p tidemark-nats`), only what they name.
if [ "$#" -eq 0 ]; then set -- --workspace; fi
cargo test "$@"
