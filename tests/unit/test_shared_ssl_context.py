"""The suite's httpx clients share one default SSL context (``share_default_ssl_context`` in
tests/conftest.py): a client made with the default TLS settings (an SDK's too) loads no CA bundle
of its own, and one made with other settings still gets its own context."""

from __future__ import annotations

import ssl

import httpx
import httpx._transports.default as transports
import openai


def context_of(client: object) -> ssl.SSLContext:
    """The SSL context an httpx (or httpx2) client's connection pool would use for an https:// URL."""
    context = client._transport._pool._ssl_context  # type: ignore[attr-defined]
    assert isinstance(context, ssl.SSLContext)
    return context


def test_default_clients_share_one_context_and_other_settings_get_their_own() -> None:
    with httpx.Client() as one, httpx.Client(timeout=5) as two, httpx.Client(verify=False) as unverified:
        assert context_of(one) is context_of(two)
        assert context_of(one).verify_mode == ssl.CERT_REQUIRED and context_of(one).check_hostname
        assert context_of(unverified) is not context_of(one)
        assert context_of(unverified).verify_mode == ssl.CERT_NONE
    own = ssl.create_default_context()
    with httpx.Client(verify=own) as client:
        assert context_of(client) is own
    assert transports.create_ssl_context() is transports.create_ssl_context()


def test_an_sdk_client_shares_the_default_context_of_its_http_library() -> None:
    one = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-test")
    two = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-test")
    with one, two:
        assert context_of(one._client) is context_of(two._client)
