"""Where the project keeps its data, caches and local state (all relative to the checkout)."""
from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PATCHSETS_DIR = PROJECT_ROOT / "patchsets"
HOSTS_DIR = PROJECT_ROOT / "hosts"
TEMPLATES_DIR = PROJECT_ROOT / "templates"
STACKS_DIR = PROJECT_ROOT / "stacks"
PROFILES_DIR = PROJECT_ROOT / "profiles"


def cache_dir() -> Path:
    """Downloads (wheels, built images) shared by tasks, tests and CI; git-ignored."""
    return Path(os.environ.get("TOOLKIT_CACHE", PROJECT_ROOT / ".cache"))


def sandbox_dir() -> Path:
    """The sandbox host's sshd config, keys and host-side venv; git-ignored."""
    return Path(os.environ.get("TOOLKIT_SANDBOX_DIR", PROJECT_ROOT / ".sandbox"))
