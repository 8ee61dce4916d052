"""The service's bearer token: where it comes from and how a request is checked.

Ray's own token authentication does not cover Serve's HTTP routes, so the service checks
its own. The deployment is given only the token's SHA-256 (never the token), so the secret
does not end up in the Serve config, the dashboard or the logs.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat

TOKEN_ENV = "RAYDIT_API_TOKEN"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def load_or_create_token(path: str | None) -> tuple[str, bool]:
    """The token from `path` (created with mode 0600 when absent), or from $RAYDIT_API_TOKEN
    when `path` is None. Returns (token, created)."""
    if path is None:
        token = os.environ.get(TOKEN_ENV, "").strip()
        if not token:
            raise ValueError(f"no token: set {TOKEN_ENV} or pass --token-file PATH")
        return token, False
    if os.path.exists(path):
        if not os.path.isfile(path):
            raise ValueError(f"--token-file {path!r} is not a file")
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise ValueError(
                f"--token-file {path!r} is readable by other users (mode {mode:o}); "
                f"run `chmod 600 {path}`"
            )
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
        if len(token) < 16:
            raise ValueError(f"--token-file {path!r} holds a token of {len(token)} characters; use 16 or more")
        return token, False
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    # O_EXCL: never overwrite a file another process created meanwhile.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return token, True


def bearer_ok(header: str | None, digest: str) -> bool:
    """True when `Authorization: Bearer <token>` carries the token whose digest is `digest`."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return False
    return hmac.compare_digest(token_digest(value.strip()), digest)
