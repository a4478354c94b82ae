"""GGUF tokenizers kept on disk between starts.

Building Gemma 3's 262,144-token tokenizer from its GGUF file (decoding the header's strings,
then the token bytes, ranks and special-token splitters) takes 1.5 s of a 2-core start, and every
start builds the same one; unpickled, it takes 0.25 s. So `load_gguf` keeps each built tokenizer
under `$LIFELINE_CACHE_DIR/tokenizers` (default `~/.cache/lifeline`), keyed by the file (its real
path, size and modification time), Python's version and Lifeline's tokenizer sources, and a later
load of the same file takes it from there and steps over the header's vocabulary arrays without
decoding them. A file that cannot be read or unpickled, or holds something else, is ignored and
written again; the write is atomic (two servers starting at once each write a whole file).
`LIFELINE_TOKENIZER_CACHE=0` turns the cache off. The cache directory is the user's own, as the
compiled graphs' beside it are: what it holds is run."""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHE_FORMAT = 1


def cache_root() -> Path:
    """`$LIFELINE_CACHE_DIR`, by default `~/.cache/lifeline` (`$XDG_CACHE_HOME` where set)."""
    root = os.environ.get("LIFELINE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "lifeline")
    return Path(root)


def tokenizer_cache_dir() -> Path | None:
    """Where tokenizers are kept; None with `LIFELINE_TOKENIZER_CACHE=0`."""
    if os.environ.get("LIFELINE_TOKENIZER_CACHE", "1").strip().lower() in (
            "0", "false", "off", "no"):
        return None
    return cache_root() / "tokenizers"


@functools.cache
def _sources_digest() -> str:
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _entry(path: str | os.PathLike[str]) -> Path | None:
    directory = tokenizer_cache_dir()
    if directory is None:
        return None
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return None
    parts = [CACHE_FORMAT, sys.version, real, st.st_size, st.st_mtime_ns, _sources_digest()]
    return directory / (hashlib.sha256(repr(parts).encode()).hexdigest()[:32] + ".pkl")


def cached_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer kept for the GGUF file at `path`, or None."""
    from lifeline.tokenizer.gguf_tokenizer import GGUFTokenizer

    entry = _entry(path)
    if entry is None:
        return None
    try:
        with open(entry, "rb") as f:
            tokenizer = pickle.load(f)
    except Exception:  # noqa: BLE001 - missing, cut, or from another setup: built again
        return None
    return tokenizer if isinstance(tokenizer, GGUFTokenizer) else None


def keep_tokenizer(path: str | os.PathLike[str], tokenizer: Any) -> None:
    """Keep `tokenizer`, built from the GGUF file at `path`, for the next load (nothing where
    the cache is off or cannot be written)."""
    entry = _entry(path)
    if entry is None:
        return
    try:
        data = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
    except Exception:  # noqa: BLE001 - a cache: a start goes on without it
        return
