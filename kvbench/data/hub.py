"""Is the Hugging Face hub reachable? Asked by tasks' `preflight` before the model loads, so a run that needs hub
data offline fails at once with one line naming the local-data option, instead of after the model load and the
hub client's retries (about 25 s).

Offline means: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set to a true value, or a TCP connection to the hub's host
(HF_ENDPOINT, default https://huggingface.co) does not open within CONNECT_TIMEOUT_S. The answer is cached for the
process.
"""
from __future__ import annotations

import os
import socket
from typing import Optional
from urllib.parse import urlparse

from kvbench.errors import UserError

CONNECT_TIMEOUT_S = 3.0
_TRUE = {"1", "true", "yes", "on"}
_cache: dict[str, Optional[str]] = {}


def hub_unreachable_reason(timeout: float = CONNECT_TIMEOUT_S) -> Optional[str]:
    """Why the hub cannot be used (a short phrase), or None when it answers."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var}={os.environ[var]}"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if endpoint in _cache:
        return _cache[endpoint]
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            reason = None
    except OSError as exc:
        reason = f"no connection to {host}:{port}: {exc.strerror or type(exc).__name__}"
    _cache[endpoint] = reason
    return reason


def require_hub(what: str, option: str) -> None:
    """UserError (one line) naming `option` when `what` would have to come from an unreachable hub."""
    reason = hub_unreachable_reason()
    if reason is not None:
        raise UserError(f"{what} comes from the Hugging Face hub, which is unreachable ({reason}): "
                        f"set {option}=<local copy> to read it from disk")
