"""What every bench script does with its figures: name the machine, print them, keep them as JSON."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()})"


def publish(figures: dict, path: Path | None) -> None:
    """Print the figures and, when a path is given, write them there (results/bench/*.json)."""
    text = json.dumps(figures, indent=2)
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
