"""What the fixture scripts share: the model file's digest and the JSON layout of a fixture."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def to_json(fixture: dict) -> str:
    """Indented JSON with each innermost list of numbers on one line. Such a list spans lines
    once indented, and a JSON string holds no raw newline: text that looks like a list inside a
    string (a prompt's '[1, 2.5e-3]') is left alone."""
    text = json.dumps(fixture, ensure_ascii=False, indent=1)
    return re.sub(r"\[\n[^\[\]{}\"]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"
