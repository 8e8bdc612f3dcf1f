"""Secrets out of what the router shows: a URL's password masked (Redis URLs carry one).

A leaf module (the standard library only), so that the configuration can mask what it
prints without importing :mod:`router.security`, which imports the configuration.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def redacted(url: str) -> str:
    """``url`` without its password, for logs and printouts."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:  # not parseable (an unclosed IPv6 bracket): show none of it
        return "***"
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
