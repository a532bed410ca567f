"""Downloads a hub model into the standard HF cache (huggingface_hub.snapshot_download): resumable, with progress.

Run as a worker job by `finetune-mcp models pull`, never during a tool call. Only what training needs is
fetched (config, weights as safetensors, tokenizer and template files), so a repo's duplicate .bin/.pth/GGUF
copies are not downloaded. An interrupted download resumes where it stopped on the next call.
"""

from __future__ import annotations

import os
from typing import Any

from finetune_mcp.common.proto import JobError, emit_progress, run_main

ALLOW = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py", "*.md", "tokenizer*", "LICENSE*"]


def pull(P: dict[str, Any]) -> dict[str, Any]:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError

    repo, revision = P["hf_id"], P.get("revision")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise JobError(f"cannot pull {repo}: HF_HUB_OFFLINE is set, so huggingface_hub makes no network call",
                       kind="Refused", where="HF_HUB_OFFLINE", fix="unset HF_HUB_OFFLINE for this command (the server sets it only for its own jobs)")
    emit_progress(0, 1, f"downloading {repo}" + (f"@{revision}" if revision else ""))
    try:
        path = snapshot_download(repo_id=repo, revision=revision, allow_patterns=ALLOW)
    except GatedRepoError:
        raise JobError(f"{repo} is gated: accept its licence on the hub and log in", kind="Refused", where=repo,
                       fix="`huggingface-cli login` (or HF_TOKEN) after accepting the terms on the model page") from None
    except RepositoryNotFoundError:
        raise JobError(f"no model repository {repo!r} on the hub (or it is private)", kind="NotFound", where=repo,
                       fix="check the id (org/name); log in for a private repo") from None
    except RevisionNotFoundError:
        raise JobError(f"{repo} has no revision {revision!r}", kind="NotFound", where=f"{repo}@{revision}") from None
    except LocalEntryNotFoundError as e:
        raise JobError(f"cannot reach the hub to download {repo}: {e}", kind="JobFailed", where=os.environ.get("HF_ENDPOINT", "https://huggingface.co"),
                       fix="check the network or proxy (HTTPS_PROXY), or HF_ENDPOINT for a mirror; run the same command again to resume") from None
    emit_progress(1, 1, "done")
    files = sorted(os.listdir(path))
    if "config.json" not in files:
        raise JobError(f"{repo} has no config.json: not a transformers model", kind="BadInput", where=path)
    return {"hf_id": repo, "revision": revision, "path": path, "files": files}


if __name__ == "__main__":
    run_main(pull)
