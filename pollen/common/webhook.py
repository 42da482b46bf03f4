"""The notification webhook's URL: what `notify-url` accepts.

`Settings` checks the key before a run starts and `runs/notify.py` checks the
URL again where it may come from the environment (`POLLEN_NOTIFY_URL`); both
ask this one rule. A webhook URL carries its credentials in its path, so a URL
read from the environment is never repeated in an error message.
"""

from __future__ import annotations

from urllib.parse import urlsplit

KEY = "notify-url"
URL_ENV = "POLLEN_NOTIFY_URL"
ALLOWED = "an http(s) URL, or empty"


def check_url(url: str, *, from_env: bool = False) -> str:
    """Return `url` if it is an http(s) URL with a host, else raise ValueError.

    A URL read from `POLLEN_NOTIFY_URL` is not repeated in the message: the
    environment is where secrets are kept.
    """
    try:
        parts = urlsplit(url)
        valid = (
            parts.scheme in ("http", "https")
            and bool(parts.hostname)
            and (parts.port is None or parts.port > 0)
            and not any(c.isspace() or not c.isprintable() for c in url)
        )
    except ValueError:  # a malformed port or IPv6 host
        valid = False
    if not valid:
        shown = f"the URL from {URL_ENV}" if from_env else repr(url)
        raise ValueError(f"invalid value for {KEY!r}: {shown}; allowed: {ALLOWED}")
    return url
