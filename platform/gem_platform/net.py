"""Addresses the platform talks to (Ray, Jobs API, MLflow, storage): one reachability probe, and
the redaction of credentials from any URI before it is shown or stored.

The probe is a TCP connect with a short timeout, so a wrong address fails in seconds, not
after the clients' own minutes of retries.
"""

from __future__ import annotations

import re
import socket
import urllib.parse

from gem_platform.errors import GemError

MASK = "***"

# scheme://user:password@host or scheme://token@host (the scheme may be missing):
# everything between '//' and '@'.
# user:password@ (a password pasted without percent-encoding may hold '?', '#' and '@': it
# ends at the last '@' before the host) or a lone token@.
_USERINFO = re.compile(r"(?P<scheme>(?:[A-Za-z][A-Za-z0-9+.\-]*)?://)"
                       r"(?P<userinfo>[^\s/?#@:]+:[^\s/]*?(?=@[^\s/@]*(?:[\s/]|$))|[^/\s?#]+)@")
# ?token=...&password=...: query parameters whose name says they hold a secret.
_SECRET_PARAM = re.compile(
    r"(?P<key>[?&;](?:[A-Za-z0-9_.\-]*(?:token|secret|password|passwd|pwd|key|signature|sig|"
    r"credential|auth)[A-Za-z0-9_.\-]*))=(?P<value>[^&;#\s]*)", re.IGNORECASE)


def connect_error(host: str, port: int, timeout: float = 3.0) -> OSError | None:
    """None if a TCP connection to host:port opens within ``timeout``, else the error (an
    OSError naming the host where it is no host name at all: characters no DNS name holds)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as err:
        return err
    except UnicodeError as err:  # the IDNA codec refuses the name before any lookup
        return OSError(f"{host!r} is not a valid host name: {err}")


def require_reachable(host: str, port: int, what: str, fix: str,
                      error: type[GemError] = GemError, timeout: float = 3.0) -> None:
    """Raise ``error`` ("WHAT is unreachable (why)." and ``fix``) unless a TCP connection to
    host:port opens within ``timeout``: the one reachability check of every address the
    platform talks to (Ray cluster, Ray Jobs server, MLflow server, tracking database).
    ``what`` names the address as the user gave it, credentials already masked."""
    err = connect_error(host, port, timeout)
    if err is not None:
        raise error(f"{what} is unreachable ({err}).", fix)


def default_port(parsed: urllib.parse.ParseResult) -> int:
    """The port of an http(s) URL: its own, else the scheme's (443 for https, else 80)."""
    return parsed.port or (443 if parsed.scheme.lower() == "https" else 80)


def parse_url(text: str, what: str, fix: str, error: type[GemError] = GemError
              ) -> urllib.parse.ParseResult:
    """``text`` parsed as a URL, or ``error`` naming ``what`` (e.g. "MLflow tracking URI")
    with the credentials masked: for control characters, a '[' that opens no IPv6 address, a
    port that is not a number from 0 to 65535."""
    shown = _shown_in_error(text)[:200]
    bad = next((ch for ch in text if ord(ch) < 32 or ord(ch) == 127), None)
    if bad is not None:
        raise error(f"{what} {shown!r} holds the control character {bad!r}.", fix)
    try:
        parsed = urllib.parse.urlparse(text)
        parsed.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as err:
        raise error(f"{what} {shown!r} is malformed ({err}).", fix) from None
    return parsed


def _shown_in_error(text: str) -> str:
    """``text`` as a message about a URL that may not parse may show it: everything before
    the last '@' of its authority masked, since a password pasted with an unencoded '/' ends
    the authority where a parser (or redact) would not expect it."""
    scheme, sep, rest = text.partition("://")
    if sep and "@" in rest:
        return f"{scheme}://{MASK}@{rest.rsplit('@', 1)[1]}"
    return redact(text)


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
