"""Who a request belongs to, in a form that may leave the process.

An API key never leaves the process that received it; what does is a digest keyed with a
secret drawn once per process (`PROCESS_SECRET`): the same key or text gives the same digest for
as long as the process runs, and another one in the next process. Nobody holding a digest (an
upstream, a log reader, a client reading its routing record) can confirm a guess by hashing it
(a user id, a prompt's opening words, a short key), nor match digests across processes.

- `tenant_salt`: the `cache_salt` that keeps a caller's prefix-cache blocks and image embeddings
  its own (`salt_cache_by_api_key`, on a single server and at the gateway, which sends it to
  every backend in place of the client's own salt).
- `tenant_of`: the caller as the gateway's records know it (`/gateway/decisions` shows a caller
  its own requests).
- `reported_hash`: a prompt's or a session's hash as a routing record shows it."""
from __future__ import annotations

import hashlib
import secrets

PROCESS_SECRET = secrets.token_bytes(32)


def keyed_digest(text: str, purpose: bytes, size: int = 16) -> bytes:
    """BLAKE2b of `text` under this process's secret; `purpose` (up to 16 bytes) keeps the
    digests of one use apart from another's."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size,
                           key=PROCESS_SECRET, person=purpose).digest()


def tenant_of(api_key: str) -> str:
    """The caller's identity, never its key: 32 hex digits."""
    return keyed_digest(api_key, b"lifeline-tenant").hex()


def tenant_salt(api_key: str, salt: str | None) -> str:
    """The prefix-cache salt of a request under `salt_cache_by_api_key`: the caller's identity,
    then a digest of the request's own `cache_salt` (requests of one tenant still share blocks
    only when their salts are equal). 72 characters at most, so any server that takes vLLM's
    `cache_salt` takes it."""
    own = keyed_digest(salt, b"lifeline-salt").hex() if salt else ""
    return f"tenant:{tenant_of(api_key)}:{own}"


def reported_hash(text: str) -> str:
    """A prompt prefix's or a session key's hash as a record shows it: 16 hex digits."""
    return keyed_digest(text, b"lifeline-record", 8).hex()
