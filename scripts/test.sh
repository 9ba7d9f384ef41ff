#!/usr/bin/env bash
# Runs every test of the workspace. Provisions a nats-server >= 2.10 into the git-ignored
# .tools/ folder first (no root needed), because the NATS tests start real servers.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/provision-nats.sh
cargo test --workspace "$@"
