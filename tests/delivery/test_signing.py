"""Signed requests (Standard Webhooks): wowd's signature is the documented recipe, computed here
with the standard library alone; the test vector of docs/delivery.md is that recipe's; the
verifier accepts what the recipe signs and refuses the rest."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path

import pytest

from wowd.signing import InvalidSecret, InvalidSignature, Signer, secret_key, sign, verify

DOCS = Path(__file__).resolve().parents[2] / "docs" / "delivery.md"

KEY = b"wowd-signing-test-vector-key-32b"
OLD_KEY = b"wowd-rotation-old-secret-key-32b"
SECRET = "whsec_" + base64.b64encode(KEY).decode()
OLD_SECRET = "whsec_" + base64.b64encode(OLD_KEY).decode()
MSG_ID = "9c1d0e6f2b7a4c3e8d5f1a2b3c4d5e6f"
TIMESTAMP = 1767225600
BODY = b'{"reason":"unpaid"}'


def recipe(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The documented recipe, written independently of wowd: v1, base64 of HMAC-SHA256 over
    ``{id}.{timestamp}.{body}``."""
    mac = hmac.new(key, msg_id.encode() + b"." + str(timestamp).encode() + b"." + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def test_wowd_signs_as_the_recipe_says_one_signature_per_secret_in_order() -> None:
    headers = sign([SECRET, OLD_SECRET], MSG_ID, BODY, timestamp=TIMESTAMP)
    assert headers == {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(TIMESTAMP),
        "webhook-signature": f"{recipe(KEY, MSG_ID, TIMESTAMP, BODY)} {recipe(OLD_KEY, MSG_ID, TIMESTAMP, BODY)}",
    }


def test_the_documented_test_vector_is_the_recipes() -> None:
    text = DOCS.read_text()
    section = text[text.index("**Test vector.**") : text.index("**In Python**")]
    assert SECRET in section and OLD_SECRET in section and KEY.decode() in section
    assert f"{MSG_ID}.{TIMESTAMP}.{BODY.decode()}" in section
    signatures = re.findall(r"v1,[A-Za-z0-9+/=]+", section)
    assert signatures[0] == recipe(KEY, MSG_ID, TIMESTAMP, BODY)
    assert signatures[-2:] == [recipe(KEY, MSG_ID, TIMESTAMP, BODY), recipe(OLD_KEY, MSG_ID, TIMESTAMP, BODY)]
    assert signatures[0] == "v1,J/PqJ5buCp3aMpFHD1RLKrrAz6IrbkGycxqApGQ6Ir0="


def test_signer_stamps_the_time_of_the_request() -> None:
    headers = Signer([SECRET]).headers(MSG_ID, BODY)
    ts = int(headers["webhook-timestamp"])
    assert headers["webhook-signature"] == recipe(KEY, MSG_ID, ts, BODY)
    verify([SECRET], headers, BODY)


def _signed(signature: str, timestamp: int = TIMESTAMP) -> dict[str, str]:
    return {"Webhook-Id": MSG_ID, "Webhook-Timestamp": str(timestamp), "Webhook-Signature": signature}


def test_verify_accepts_a_signature_of_any_secret_whatever_the_header_case() -> None:
    both = f"{recipe(KEY, MSG_ID, TIMESTAMP, BODY)} {recipe(OLD_KEY, MSG_ID, TIMESTAMP, BODY)}"
    verify([OLD_SECRET], _signed(both), BODY, now=TIMESTAMP)  # the receiver not rotated yet
    verify([SECRET], _signed(both), BODY, now=TIMESTAMP)  # rotated
    verify([KEY], _signed(both), BODY.decode(), now=TIMESTAMP + 299)  # a key as bytes, a str body
    verify([SECRET], _signed("v1a,ignored " + recipe(KEY, MSG_ID, TIMESTAMP, BODY)), BODY, now=TIMESTAMP)


@pytest.mark.parametrize(
    ("headers", "body", "now", "says"),
    [
        (_signed(recipe(KEY, MSG_ID, TIMESTAMP, BODY)), BODY + b" ", TIMESTAMP, "no signature matches"),
        (_signed(recipe(OLD_KEY, MSG_ID, TIMESTAMP, BODY)), BODY, TIMESTAMP, "no signature matches"),
        (_signed(recipe(KEY, MSG_ID, TIMESTAMP, BODY)), BODY, TIMESTAMP + 301, "more than 300s away"),
        (_signed(recipe(KEY, MSG_ID, TIMESTAMP, BODY)), BODY, TIMESTAMP - 301, "more than 300s away"),
        (_signed(recipe(KEY, MSG_ID, TIMESTAMP, BODY).replace("v1,", "v2,")), BODY, TIMESTAMP, "no signature"),
        ({"webhook-id": MSG_ID, "webhook-timestamp": str(TIMESTAMP)}, BODY, TIMESTAMP, "no webhook-signature"),
        (_signed("v1,x", timestamp=0) | {"Webhook-Timestamp": "soon"}, BODY, TIMESTAMP, "not an integer"),
        # beyond a float's range: a verification failure, not OverflowError (a handler's 500)
        (_signed("v1,x") | {"Webhook-Timestamp": "9" * 400}, BODY, TIMESTAMP, "not an integer"),
        (_signed("v1,x") | {"Webhook-Timestamp": "-1767225600"}, BODY, TIMESTAMP, "not an integer"),
    ],
    ids=[
        "body changed",
        "other secret",
        "too old",
        "too new",
        "unknown version",
        "unsigned",
        "bad timestamp",
        "400 digits",
        "negative",
    ],
)
def test_verify_refuses(headers: dict[str, str], body: bytes, now: int, says: str) -> None:
    with pytest.raises(InvalidSignature, match=says):
        verify([SECRET], headers, body, now=now)


@pytest.mark.parametrize(
    ("secret", "says"),
    [
        ("d293ZC1zaWduaW5nLXRlc3QtdmVjdG9yLWtleS0zMmI=", "starts with 'whsec_'"),
        ("whsec_not base64!", "followed by standard base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "at least 16 bytes"),
    ],
)
def test_a_malformed_secret_is_refused_without_repeating_it(secret: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        secret_key(secret)
    assert secret not in str(caught.value)


def test_verify_takes_one_secret_or_a_list_and_tells_a_bad_secret_from_a_bad_request() -> None:
    """One secret string is one secret (not its characters); a secret that is not one is the
    receiver's configuration at fault, :class:`InvalidSecret` naming which, whatever the
    request; the documented test vector checks with ``now`` set to its time."""
    headers = {
        "webhook-id": MSG_ID,
        "webhook-timestamp": str(TIMESTAMP),
        "webhook-signature": "v1,J/PqJ5buCp3aMpFHD1RLKrrAz6IrbkGycxqApGQ6Ir0=",
    }
    verify(SECRET, headers, BODY, now=TIMESTAMP)  # docs/delivery.md's vector, as its example checks it
    verify([OLD_SECRET, SECRET], headers, BODY, now=TIMESTAMP)
    assert Signer(SECRET).headers(MSG_ID, BODY, TIMESTAMP) == headers
    with pytest.raises(InvalidSecret, match="^secret 2 of 2: a signing secret starts with 'whsec_'$"):
        verify([SECRET, "d293ZC1zaWduaW5n"], headers, BODY, now=TIMESTAMP)
    with pytest.raises(InvalidSecret, match="followed by standard base64"):
        verify("whsec_not base64!", {}, BODY)  # before the request is looked at
    text = DOCS.read_text()
    example = text[text.index("**In Python**") : text.index("The Standard Webhooks libraries")]
    assert "now=1767225600" in example
