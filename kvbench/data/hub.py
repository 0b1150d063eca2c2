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


# ----------------------------------------------------------------------------------------------- dataset revisions
# Hub data is identified by the dataset's revision (a commit of its repository), as packaged data is by its
# package's version and local files by their digest (kvbench.run.data_digest). `task.revision` pins one (a branch, tag
# or commit; the commit makes the run id name the data); null reads the default branch, and either way the commit
# actually read is recorded in metrics.json as `data_revision` ("<repo>@<commit>", several joined by "; ").
_revisions_read: dict[str, str] = {}


def check_revision(value: Optional[str], local_option: str, local_value: Optional[str]) -> None:
    """UserError (one line) for a `task.revision` that is not a revision name, or one set beside local data."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip() or any(c.isspace() for c in value):
        raise UserError(f"invalid task.revision={value!r}: expected a branch, tag or commit of the hub dataset "
                        "(no spaces), or null (the default branch)")
    if local_value is not None:
        raise UserError(f"task.revision={value!r} pins the hub's data but task.{local_option}={local_value!r} "
                        f"reads a local copy: drop one of them")


def resolved_commit(repo: str, revision: Optional[str]) -> str:
    """The commit of hub dataset `repo` that `revision` (null: the default branch) names now, or the revision as
    given when the hub does not say (a commit id is its own answer)."""
    if revision is not None and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    if hub_unreachable_reason() is not None:  # a local stand-in for the hub (tests, a mirror): nothing to ask
        return revision or "unresolved"
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(repo, revision=revision).sha
    except Exception:  # the data was read, so the hub answered: a failure here only loses the commit id
        sha = None
    return sha or (revision or "unresolved")


def note_revision_read(repo: str, revision: Optional[str]) -> None:
    """Record that the run read hub dataset `repo` at `revision` (resolved to its commit)."""
    if repo not in _revisions_read:
        _revisions_read[repo] = resolved_commit(repo, revision)


def revisions_read(clear: bool = False) -> Optional[str]:
    """"<repo>@<commit>; ..." of the hub datasets read since the last clear (None when none was)."""
    out = "; ".join(f"{repo}@{sha}" for repo, sha in sorted(_revisions_read.items())) or None
    if clear:
        _revisions_read.clear()
    return out
