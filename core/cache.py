"""Where ggrun keeps what it downloads or builds once per machine (models, compiled kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """ggrun's cache: $GGRUN_CACHE, else ~/.cache/ggrun."""
    env = os.environ.get("GGRUN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ggrun"
