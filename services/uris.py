"""URIs shown to people: status lines, error messages, report pages."""

from __future__ import annotations

import re
from urllib.parse import urlsplit


def redact(uri: str) -> str:
    """``uri`` without its password (``postgresql://user:***@host/db``), for what people read.

    A string that is not a parsable URL loses whatever stands between ``user:`` and ``@``.
    """
    try:
        password = urlsplit(uri).password
    except ValueError:  # e.g. an unbalanced '[' in the host
        return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", uri)
    if password:
        parts = urlsplit(uri)
        return parts._replace(netloc=parts.netloc.replace(f":{password}@", ":***@")).geturl()
    return uri
