#!/usr/bin/env bash
# Install Debian's chromium for the chat page's browser test (tests/cli/serve/test_chat_page.py), where it is
# missing and this is a Debian-like machine we are root on; CI runs it (scripts/test.sh with CI set). The test
# skips where no chromium is, so a machine where this cannot install it still passes.
set -uo pipefail
say() { echo "setup_browser: $*" >&2; }
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    say "no chromium, and no apt-get as root to install it: the chat page's browser test will skip"
    exit 0
fi
say "installing chromium (apt-get) for the chat page's browser test"
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }; then
    say "could not install chromium: the chat page's browser test will skip"
fi
exit 0
