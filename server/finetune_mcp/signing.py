"""The verdict key pair and the signed machine block of promotion-report.md (Ed25519, via cryptography).

The eval role signs; export verifies with the public key only. Keys live under
$DGX_SPARK_ROOT/.finetune-mcp-keys/, a folder the training role's guard denies outright, so no tool
argument of that role can read or replace them. The private key is created on first use, mode 0600.
The same key signs evaluate_checkpoint's result (eval/<experiment>/results/<run>.json, schema
EVAL_SCHEMA): a JSON object whose "signature" covers canonical(the object without "signature").

Machine block: the only fenced ```json block that follows the line MARKER in the report. It holds
one JSON object; "signature" is base64 of the Ed25519 signature over canonical(payload), where
payload is the object without "signature" and canonical() is sorted keys, no spaces, UTF-8.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from finetune_mcp.common.errors import FtError, Refused
from finetune_mcp.workspace import Workspace

KEY_DIR = ".finetune-mcp-keys"
PRIVATE_NAME = "verdict-ed25519.key"
PUBLIC_NAME = "verdict-ed25519.pub"
SCHEMA = "finetune-mcp/verdict/v1"
EVAL_SCHEMA = "finetune-mcp/eval-result/v1"
MARKER = "<!-- finetune-mcp:signed-verdict (edit nothing below: the signature covers it) -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\s*```json\n(.*?)\n```", re.S)


class BadSignature(Refused):
    """A machine block that is missing, malformed, or not signed by this workspace's eval key."""


def key_dir(ws: Workspace) -> Path:
    return ws.keys_dir


def canonical(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _raw_public(public_key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public_key) -> str:
    return "ed25519:" + hashlib.sha256(_raw_public(public_key)).hexdigest()[:16]


def _write_new(path: Path, data: bytes, mode: int) -> bool:
    """Create path with data only if it does not exist yet (link(2) refuses to overwrite); True if ours won."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
    finally:
        os.unlink(tmp)


def load_or_create_private_key(ws: Workspace):
    """The eval role's signing key; made on first use. Only the eval-role server calls this."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = key_dir(ws)
    # 0711: the training user reaches the public half by its name (export verifies), never lists or reads the rest.
    d.mkdir(mode=0o711, parents=True, exist_ok=True)
    priv_path, pub_path = ws.private_key_path, ws.public_key_path
    if not priv_path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        # Two eval servers starting at once: whichever links first wins, the other reads its key.
        _write_new(priv_path, pem, 0o600)
    st = priv_path.stat()
    if st.st_mode & 0o077:
        raise Refused(
            f"the verdict signing key is readable by others (mode {st.st_mode & 0o777:o})",
            where=str(priv_path),
            fix=f"chmod 600 {priv_path}",
        )
    key = serialization.load_pem_private_key(priv_path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise FtError("the verdict signing key is not an Ed25519 key", where=str(priv_path), fix="move it away; a new pair is made on the next verdict")
    pub_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    if not pub_path.exists() or pub_path.read_bytes() != pub_pem:
        # The public half is derived, so rewriting it from the private key is always safe.
        from finetune_mcp.workspace import atomic_write_bytes

        atomic_write_bytes(pub_path, pub_pem, 0o644)
    return key


def load_public_key(ws: Workspace):
    """The verification key, read by the server itself at a fixed path (never through a caller's path)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    pub_path = ws.public_key_path
    try:
        key = serialization.load_pem_public_key(pub_path.read_bytes())
    except FileNotFoundError:
        raise BadSignature(
            "no verdict key exists in this workspace, so no verdict here was ever signed by the eval role",
            where=str(pub_path),
            fix="hand the run to the eval engineer: evaluate_checkpoint, then record_verdict",
        ) from None
    except ValueError as e:
        raise BadSignature(f"the verdict public key cannot be read: {e}", where=str(pub_path)) from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadSignature("the verdict public key is not an Ed25519 key", where=str(pub_path))
    return key


def sign_block(private_key, payload: dict[str, Any], schema: str = SCHEMA) -> dict[str, Any]:
    """payload + schema + key_id + signature, ready to render (or to write as JSON)."""
    body = {**payload, "schema": schema, "key_id": key_id(private_key.public_key())}
    body.pop("signature", None)
    sig = private_key.sign(canonical(body))
    return {**body, "signature": base64.b64encode(sig).decode("ascii")}


def verify_signed(doc: Any, public_key, schema: str, where: str, what: str, fix: str) -> dict[str, Any]:
    """doc without its signature once it verifies under this workspace's eval key, else BadSignature naming what is wrong."""
    from cryptography.exceptions import InvalidSignature

    if not isinstance(doc, dict):
        raise BadSignature(f"{what} is not a JSON object", where=where, fix=fix)
    body = dict(doc)
    try:
        sig = base64.b64decode(body.pop("signature"), validate=True)
    except (ValueError, KeyError, TypeError) as e:
        raise BadSignature(f"{what} is malformed ({type(e).__name__}: {e})", where=where, fix=fix) from None
    if body.get("schema") != schema:
        raise BadSignature(f"{what} has schema {body.get('schema')!r}, expected {schema!r}", where=where, fix=fix)
    if body.get("key_id") != key_id(public_key):
        raise BadSignature(
            f"{what} was signed with key {body.get('key_id')!r}, not this workspace's eval key {key_id(public_key)!r}",
            where=where,
            fix="it must come from the eval-engineer server of this workspace; " + fix,
        )
    try:
        public_key.verify(sig, canonical(body))
    except InvalidSignature:
        raise BadSignature(f"the signature of {what} does not verify: it was written or edited after the eval role signed it",
                           where=where, fix=fix) from None
    return body


def render_block(block: dict[str, Any]) -> str:
    return MARKER + "\n```json\n" + json.dumps(block, indent=2, sort_keys=True, ensure_ascii=False) + "\n```\n"


def verify_report(text: str, public_key, where: str) -> dict[str, Any]:
    """The payload of the report's signed block, or BadSignature saying what is wrong with it."""
    from cryptography.exceptions import InvalidSignature

    blocks = _BLOCK.findall(text)
    if not blocks:
        raise BadSignature(
            "promotion-report.md carries no signed verdict block",
            where=where,
            fix="only record_verdict (eval-engineer role) writes a valid promotion report; ask the eval engineer for a verdict",
        )
    if len(blocks) > 1:
        raise BadSignature("promotion-report.md carries more than one verdict block", where=where, fix="ask the eval engineer to record the verdict again")
    try:
        block = json.loads(blocks[0])
        sig = base64.b64decode(block.pop("signature"), validate=True)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise BadSignature(f"the verdict block is malformed ({type(e).__name__}: {e})", where=where, fix="ask the eval engineer to record the verdict again") from None
    if block.get("schema") != SCHEMA:
        raise BadSignature(f"the verdict block has schema {block.get('schema')!r}, expected {SCHEMA!r}", where=where)
    if block.get("key_id") != key_id(public_key):
        raise BadSignature(
            f"the verdict was signed with key {block.get('key_id')!r}, not this workspace's eval key {key_id(public_key)!r}",
            where=where,
            fix="a verdict must be recorded by the eval-engineer server of this workspace; ask it for a verdict on this run",
        )
    try:
        public_key.verify(sig, canonical(block))
    except InvalidSignature:
        raise BadSignature(
            "the verdict block's signature does not verify: the report was written or edited by hand",
            where=where,
            fix="ask the eval engineer to record the verdict again with record_verdict",
        ) from None
    return block
