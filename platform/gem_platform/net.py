"""Addresses the platform talks to (Ray, Jobs API, MLflow, storage): one reachability probe, and
the redaction of credentials from any URI before it is shown or stored.

The probe is a TCP connect with a short timeout, so a wrong address fails in seconds, not
after the clients' own minutes of retries.
"""

from __future__ import annotations

import re
import socket

MASK = "***"

# scheme://user:password@host or scheme://token@host: everything between '//' and '@'.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/\s?#]+)@")
# ?token=...&password=...: query parameters whose name says they hold a secret.
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;](?:[A-Za-z0-9_.\-]*(?:token|secret|password|passwd|pwd|key|signature|sig|"
    r"credential|auth)[A-Za-z0-9_.\-]*))=(?P<value>[^&;#\s]*)", re.IGNORECASE)


def connect_error(host: str, port: int, timeout: float = 3.0) -> OSError | None:
    """None if a TCP connection to host:port opens within ``timeout``, else the error."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return err


def _mask_userinfo(match: re.Match[str]) -> str:
    user, sep, _secret = match["userinfo"].partition(":")
    # user:password keeps the user name (useful, not secret); a lone token is all secret.
    return f"{match['scheme']}{user}:{MASK}@" if sep else f"{match['scheme']}{MASK}@"


def redact(text: str) -> str:
    """``text`` with the credentials of every URI in it masked: the password of
    ``user:password@`` (a lone ``token@`` entirely) and the values of query parameters named
    like secrets (token, password, key, signature, ...). Anything else is returned unchanged,
    so it is safe to apply to whole messages, YAML documents and run params."""
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(_mask_userinfo, text)
    return _SECRET_PARAM.sub(lambda m: f"{m['key']}={MASK}", text)
