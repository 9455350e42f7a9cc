#!/usr/bin/env bash
# The whole test suite: unit, integration (real Ray + DeepSpeed), end to end (the quickstart).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite tests the vLLM engine on vLLM's CPU build: install it too.
export OPD_VLLM=1
scripts/setup.sh
# The report's browser test (tests/e2e/test_report_browser.py) drives Debian's headless Chromium.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: chromium and chromium-driver (apt) for the report's browser test"
    log="$(mktemp)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >"$log" 2>&1; then
      tail -n 5 "$log" >&2
      echo "warning: installing chromium failed; tests/e2e/test_report_browser.py will be skipped" >&2
    fi
    rm -f "$log"
  else
    echo "warning: no /usr/bin/chromium or /usr/bin/chromedriver (install chromium chromium-driver as root); tests/e2e/test_report_browser.py will be skipped" >&2
  fi
fi
set +e
.venv/bin/python -m pytest -v -rs --durations=15 "$@"
status=$?
set -e
# pytest's 5 means no test ran: that is a failure, not a pass.
if [ "$status" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$status"
