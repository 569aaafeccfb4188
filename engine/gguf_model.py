"""A ``.gguf`` file as a model directory the rest of tandem reads, cached.

``prepare(path)`` returns a directory under the cache (engine/default_model.py
``cache_dir()``) named after the file's fingerprint, holding what parsing the
file's metadata gives (seconds with gguf-py), so later loads skip it:

* ``config.json``: the Hugging Face Llama config the metadata describes;
* ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``: the
  file's tokenizer and chat template (engine/gguf_tokenizer.py), which the
  engine and the router (router/tokenizer.py) load from the model directory;
* ``gguf.json``: the fingerprint and the tensor table (names, types, shapes,
  offsets);
* ``model.gguf``: a link to the file itself, for the weights.

The fingerprint is a hash of the file's size and header (metadata and tensor
table, everything before the tensor data): the same file gives the same
fingerprint on every machine without reading its weights. A process finds it
again from the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from engine.gguf import (
    StoredTensor,
    TensorEntry,
    dequantized_state,
    hf_config_dict,
    read_header,
    stored_tensors,
)
from engine.packaged_model import smollm2_path  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

TABLE_FILE = "gguf.json"
LINK_NAME = "model.gguf"
_FORMAT = 1  # bump when the cached directory's contents change


def _cache_root() -> Path:
    from engine.default_model import cache_dir

    return cache_dir() / "gguf"


def file_fingerprint(path: Path, data_offset: int) -> str:
    h = hashlib.sha256(f"gguf:{path.stat().st_size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(data_offset))
    return h.hexdigest()[:32]


def _memo_file(path: Path) -> Path:
    key = hashlib.sha256(str(path).encode()).hexdigest()[:24]
    return _cache_root() / "paths" / f"{key}.json"


def _stat_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _remembered(path: Path) -> Path | None:
    """The cached directory of ``path`` if this machine prepared it unchanged before."""
    from engine.default_model import _is_complete

    try:
        memo = json.loads(_memo_file(path).read_text())
    except (OSError, ValueError):
        return None
    target = _cache_root() / memo.get("dir", "")
    if memo.get("stat") == _stat_key(path) and memo.get("format") == _FORMAT:
        return target if _is_complete(target) else None
    return None


def _remember(path: Path, target: Path) -> None:
    memo = _memo_file(path)
    memo.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".tmp-{os.getpid()}")
    data = {"stat": _stat_key(path), "dir": target.name, "format": _FORMAT}
    tmp.write_text(json.dumps(data))
    os.replace(tmp, memo)


def _link(target: Path, path: Path) -> None:
    """Point ``target/model.gguf`` at ``path`` (atomically; a copy of the same file
    elsewhere may have been linked before)."""
    link = target / LINK_NAME
    if link.is_symlink() and Path(os.readlink(link)) == path:
        return
    tmp = target / f".{LINK_NAME}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(path, tmp)
    os.replace(tmp, link)


def prepare(path: Path) -> Path:
    """The model directory of the GGUF file ``path`` (built on first use, cached)."""
    from engine.default_model import _build_cached

    path = path.expanduser().resolve()
    target = _remembered(path)
    if target is None:
        header = read_header(path)
        fingerprint = file_fingerprint(path, header.data_offset)
        target = _cache_root() / f"{fingerprint}-v{_FORMAT}"  # copies of a file share it

        def build(tmp: Path) -> None:
            _write_model_dir(tmp, path, header, fingerprint)

        _build_cached(target, build)
        _remember(path, target)
    _link(target, path)
    return target


def _write_model_dir(out: Path, path: Path, header: Any, fingerprint: str) -> None:
    import transformers

    from engine.gguf_tokenizer import write_tokenizer

    config = hf_config_dict(header)
    transformers.LlamaConfig(**config).save_pretrained(out)
    write_tokenizer(header.metadata, path, out)
    table = {
        "fingerprint": fingerprint,
        "file_size": path.stat().st_size,
        "config": config,
        "tensors": [t.to_json() for t in header.tensors],
    }
    (out / TABLE_FILE).write_text(json.dumps(table))
    os.symlink(path, out / LINK_NAME)


def gguf_table(model_dir: Path) -> dict[str, Any] | None:
    """The cached table of a prepared directory; None for any other directory."""
    file = model_dir / TABLE_FILE
    if not file.is_file():
        return None
    return json.loads(file.read_text())


def stored_weights(model_dir: Path) -> dict[str, StoredTensor]:
    """The tensors of a prepared directory's file, as stored (quantized blocks kept),
    by Hugging Face name: the hook for kernels that run quantized weights."""
    table = gguf_table(model_dir)
    if table is None:
        raise FileNotFoundError(f"{model_dir} is not a prepared GGUF model directory")
    entries = [TensorEntry.from_json(t) for t in table["tensors"]]
    link = model_dir / LINK_NAME
    if not link.exists():
        raise FileNotFoundError(f"{link} points at a missing file ({os.readlink(link)})")
    return stored_tensors(link, entries, table["config"])


def load_gguf_state(model_dir: Path) -> dict[str, Any]:
    """The float32 state dict (Hugging Face names) of a prepared directory's file."""
    return dequantized_state(stored_weights(model_dir))
