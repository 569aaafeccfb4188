"""The embedded default model and the random-checkpoint factory.

tandem ships no weights and the test machines have no model hub, so
everything a test or a benchmark needs is built offline here:

* a byte-level BPE tokenizer trained on the Python standard library's own
  ``.py`` sources (deterministic on a given Python version);
* ``tandem-tiny-llama``: a small Llama with random weights (fixed seed);
* ``make_random_checkpoint``: a Hugging Face checkpoint directory
  (``config.json`` + ``model.safetensors`` + tokenizer files) for any
  Llama-family config, and ``tiny_config`` for small test configs.

Built artefacts are cached under :func:`cache_dir`. Building is safe when
several processes ask at once: one builds under an ``fcntl`` lock into a
temporary directory next to the target and renames it into place, so a
partly built directory is never visible; the others wait and reuse it.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import math
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import transformers
from transformers import PretrainedConfig

from engine.config import DEFAULT_MODEL_NAME

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so they get ids 0..4 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML-style template. ``add_generation_prompt`` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_VOCAB_SIZE = 32000
DEFAULT_SEED = 0

# Bump when the format of a cached artefact changes, so stale caches are ignored.
_FORMAT_VERSION = 1
# The default model's own version: bump when its config changes (2: 4096 positions).
_MODEL_VERSION = 2
_COMPLETE_MARKER = ".tandem-complete"
_CORPUS_CAP_BYTES = 12 * 1024 * 1024

# Target standard deviation of the random models' logits. With the default
# init (std 0.02) the logits of a random model have a std of about
# 0.02 * sqrt(hidden_size) (0.3 for hidden 256): next-token distributions are
# nearly uniform and greedy decoding is full of near-ties, which makes
# token-for-token comparisons against Hugging Face fragile. A std of a few
# units gives peaked, realistic distributions: the top-1/top-2 gap is then far
# larger than fp32 round-off between two implementations.
_LOGIT_STD = 4.0


def cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR``, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tandem"


# ---------------------------------------------------------------------------
# Atomic, locked building into the cache


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _is_complete(path: Path) -> bool:
    return (path / _COMPLETE_MARKER).is_file()


def _build_cached(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` if not cached.

    Only one process builds (``fcntl`` lock); the result appears at ``target``
    in one ``os.rename``, completion marker included.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        # Holding the lock, anything left here was abandoned by a crashed builder.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            (tmp / _COMPLETE_MARKER).write_text(f"{_FORMAT_VERSION}\n")
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _py_tag() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


# ---------------------------------------------------------------------------
# Tokenizer


def _corpus_files() -> list[Path]:
    """The standard library's ``.py`` files in sorted order (no site-packages)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib)
        if rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        files.append(rel)
    return [stdlib / rel for rel in sorted(files, key=lambda p: p.as_posix())]


def _corpus() -> Iterator[str]:
    total = 0
    for path in _corpus_files():
        if total >= _CORPUS_CAP_BYTES:
            return
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(data)
        yield text


def build_tokenizer(out_dir: Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> None:
    """Train a byte-level BPE tokenizer and save it (transformers format) in ``out_dir``.

    No BOS is added automatically, so ``decode(encode(s)) == s``; special
    tokens have ids 0..4: bos, eos, pad, ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        clean_up_tokenization_spaces=False,
        padding_side="left",  # decoder-only batches pad on the left
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)


def default_tokenizer_path() -> Path:
    """The default tokenizer's directory, built once and cached."""
    target = cache_dir() / f"tokenizer-bytebpe-{DEFAULT_VOCAB_SIZE}-{_py_tag()}-v{_FORMAT_VERSION}"
    return _build_cached(target, build_tokenizer)


def _load_tokenizer(tokenizer_dir: Path):
    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _tokenizer_ids(tokenizer_dir: Path) -> dict[str, int]:
    """Vocabulary size and bos/eos/pad ids of the tokenizer in ``tokenizer_dir``."""
    path = Path(tokenizer_dir).resolve()
    # Keyed on the files' stats so a rewritten tokenizer is re-read.
    key = tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(path.iterdir())
        if f.is_file()
    )
    return dict(_tokenizer_ids_cached(str(path), key))


@functools.lru_cache(maxsize=16)
def _tokenizer_ids_cached(path: str, key: tuple) -> tuple[tuple[str, int], ...]:
    tok = _load_tokenizer(Path(path))
    return (
        ("vocab_size", len(tok)),
        ("bos_token_id", tok.bos_token_id),
        ("eos_token_id", tok.eos_token_id),
        ("pad_token_id", tok.pad_token_id),
    )


# ---------------------------------------------------------------------------
# Random checkpoints


def make_random_checkpoint(
    out_dir: Path,
    config: PretrainedConfig,
    seed: int = DEFAULT_SEED,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a random-weight checkpoint of ``config`` into ``out_dir`` and return it.

    ``out_dir`` gets ``config.json``, ``model.safetensors`` (fp32),
    ``generation_config.json`` and the tokenizer files (the default tokenizer
    unless ``tokenizer_dir`` is given). The bytes depend only on the config,
    the seed and the tokenizer.
    """
    import torch

    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else default_tokenizer_path()
    ids = _tokenizer_ids(tokenizer_dir)
    if config.vocab_size < ids["vocab_size"]:
        raise ValueError(
            f"config.vocab_size={config.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({ids['vocab_size']})"
        )

    # fork_rng: seed locally, leave the caller's global RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            # Peaked logits (see _LOGIT_STD). After the final RMSNorm a hidden
            # state has RMS 1, so logits have std ~ init_std * sqrt(hidden) * w
            # where w is the final norm's weight. Scaling that one weight works
            # the same for tied and untied embeddings and leaves the residual
            # stream (and tied input embeddings) untouched.
            lm_w = model.get_output_embeddings().weight
            init_std = float(lm_w.std())
            factor = _LOGIT_STD / (init_std * math.sqrt(config.hidden_size))
            # HF initialises biases to 0 and norm weights to 1, so a loader or a
            # forward pass that skipped them would go unnoticed. Give them random
            # values (RNG still seeded above): biases ~ N(0, init_std), norm
            # weights 1 + N(0, 0.1).
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, init_std)
                elif "norm" in name and param.dim() == 1:
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
            model.model.norm.weight.mul_(factor)

    gen = transformers.GenerationConfig(
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )
    model.generation_config = gen

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for src in sorted(tokenizer_dir.iterdir()):
        if src.is_file() and src.name != _COMPLETE_MARKER:
            shutil.copyfile(src, out_dir / src.name)
    return out_dir


def _default_config(ids: dict[str, int]) -> PretrainedConfig:
    return transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=ids["vocab_size"],
        max_position_embeddings=4096,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        tie_word_embeddings=False,
        dtype="float32",
    )


def default_model_path() -> Path:
    """The default model's directory (``tandem-tiny-llama``), built once and cached."""
    name = f"{DEFAULT_MODEL_NAME}-{_py_tag()}-v{_FORMAT_VERSION}.{_MODEL_VERSION}"
    target = cache_dir() / "models" / name
    if _is_complete(target):
        return target
    tokenizer_dir = default_tokenizer_path()

    def build(tmp: Path) -> None:
        config = _default_config(_tokenizer_ids(tokenizer_dir))
        make_random_checkpoint(tmp, config, seed=DEFAULT_SEED, tokenizer_dir=tokenizer_dir)

    return _build_cached(target, build)


# ---------------------------------------------------------------------------
# Small test configs

TINY_ARCHS = ("llama", "llama3", "qwen2", "qwen3", "mistral", "llama-tied")

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def tiny_config(arch: str, **overrides) -> PretrainedConfig:
    """A small config of ``arch`` (one of ``TINY_ARCHS``) for tests.

    Hidden 128, 2 layers, 4 heads (head_dim 32), 2 kv heads, intermediate
    256, the default tokenizer's vocabulary and special ids. ``overrides``
    are passed to the config's constructor and win over these values.
    """
    ids = _tokenizer_ids(default_tokenizer_path())
    common: dict = {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": ids["vocab_size"],
        "max_position_embeddings": 2048,
        "bos_token_id": ids["bos_token_id"],
        "eos_token_id": ids["eos_token_id"],
        "pad_token_id": ids["pad_token_id"],
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    if arch == "llama":
        cls, extra = transformers.LlamaConfig, {}
    elif arch == "llama3":
        cls, extra = transformers.LlamaConfig, {"rope_parameters": dict(_LLAMA3_ROPE)}
    elif arch == "llama-tied":
        cls, extra = transformers.LlamaConfig, {"tie_word_embeddings": True}
    elif arch == "qwen2":
        # Qwen2 always has q/k/v biases (built into the model, not a config flag).
        cls = transformers.Qwen2Config
        extra = {
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        }
    elif arch == "qwen3":
        # head_dim is explicit and differs from hidden/heads, as in real Qwen3;
        # q/k RMSNorm is part of the architecture.
        cls = transformers.Qwen3Config
        extra = {
            "head_dim": 64,
            "use_sliding_window": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        }
    elif arch == "mistral":
        cls, extra = transformers.MistralConfig, {"sliding_window": None, "head_dim": 32}
    else:
        raise ValueError(f"unknown arch {arch!r}; expected one of {TINY_ARCHS}")
    return cls(**{**common, **extra, **overrides})
