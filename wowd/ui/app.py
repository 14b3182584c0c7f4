"""The status page of a replica: ``/ui`` (HTML rendered on the server, no script) and the same
data as JSON under ``/api/v1``, read from the stores (the whole deployment) and from this
process's metrics (its delivery outcomes, fire lag and circuits; the slots it holds).

Every page and its JSON come from one function (:mod:`wowd.operator` for the stores):

======================================  =====================================================
``/ui``, ``/api/v1/overview``           status (``/api/v1/status``: ``wowd status --json``)
                                        and this process's view
``/ui/timers``, ``/api/v1/timers``      search: ``owner`` (``[CONTEXT.]AGGREGATE/ID``),
                                        ``tenant``, ``key``, ``status``, ``target``,
                                        ``due_from``/``due_until`` (ISO 8601 or epoch ms),
                                        ``after`` (the cursor of the next page)
``/ui/timer``, ``/api/v1/timer``        one timer: ``owner``, ``tenant``, ``key``
``/ui/quarantine[/ID]``                 the quarantined commits (``after``), one item
``/ui/outbox[/entry]``                  the outbox in insertion order (``offset``), one entry
======================================  =====================================================

Actions are POSTs, refused unless ``ui.token`` is set: ``/ui/timer/retry|resume`` and
``/ui/quarantine/ID/refeed`` and ``/ui/outbox/ack`` (forms: the token and the form key of the
page), ``/api/v1/...`` likewise (``Authorization: Bearer TOKEN``; the acknowledge takes
``{"request_ids": [...]}``). A POST whose ``Origin`` is
not this listener's own or whose ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` is
refused (cross-site request forgery). Command bodies are shown only to a request carrying the
token (``/ui/login`` asks a browser for it) unless ``ui.open_bodies`` (:mod:`wowd.ui.access`); a
client offering wrong tokens is slowed down. Every answer has each secret of the settings masked.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.resources import files
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from wowd import __version__
from wowd.config import WowdSettings
from wowd.errors import ConfigError, InvalidInput, StorageError, StorageUnavailable
from wowd.fmt import at, iso_ms, span
from wowd.metrics import UI_REFUSED
from wowd.model import DEFAULT_TENANT, HISTORY_ATTEMPTS, TimerStatus
from wowd.operator import (
    ENDED_DETAIL,
    TimerHistoryView,
    delivery_doc,
    detail,
    dismiss_item,
    find_timer,
    history_doc,
    outbox_entry_doc,
    outbox_page,
    owner_streams,
    parse_cursor,
    parse_ref,
    quarantine_page,
    quarantined_item,
    read_status,
    record_of,
    repair_timers,
    retry_item,
    search_timers,
    steps_needed,
    timer_doc,
    timer_history,
)
from wowd.ratelog import RateLimitedLog
from wowd.redaction import redact, secret_values
from wowd.stores.base import Backend, TimerSearch
from wowd.ui.access import TokenTries, compare, hide_bodies, offered_token, sign_notice, signed_notice
from wowd.ui.http import HttpRequest, HttpResponse
from wowd.ui.window import MetricWindow

if TYPE_CHECKING:
    import jinja2

__all__ = ["PAGE", "REFRESH_S", "StatusPage"]

log = logging.getLogger(__name__)

PAGE = 50
"""Rows per page of a list."""
BULK_CAP = 1000
"""Timers one bulk action of the page changes at most (repeat it for more)."""
MAX_MS = 253402300799999
"""The last millisecond of year 9999: the latest time a search takes."""
MAX_OFFSET_DIGITS = 12
"""An outbox offset has at most this many digits."""
REFRESH_S = 10
"""The overview reloads itself this often (``<meta http-equiv=refresh>``)."""
HTML = "text/html; charset=utf-8"
JSON = "application/json"
SECURITY_HEADERS = (
    (
        "content-security-policy",
        "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; "
        "base-uri 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "same-origin"),
)

_ASK_TOKEN = 'Basic realm="wowd status page: the token as the password", charset="UTF-8"'
"""What a browser is asked for to read command bodies (``WWW-Authenticate``)."""
_PAGE_OF_UI = re.compile(r"/ui(/[A-Za-z0-9/_.~-]*)?(\?[A-Za-z0-9_.~%=&+/:,-]*)?")
"""Where ``/ui/login`` may lead: a page of the status page, nowhere else."""

LocalSlots = Callable[[], Mapping[int, str | None]]
"""The slots this process holds now, each with why its work is stalled (``None``: progressing)."""


class _Refused(Exception):
    """A request refused: ``status`` (401, 403, 405, 429) and why (the reason label of the
    metric), with the answer's extra ``headers``."""

    def __init__(self, status: int, reason: str, message: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.headers = headers


class _NotFound(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Out:
    """What a view answers: its data (the JSON), the template that shows it, a status."""

    data: dict[str, Any]
    template: str | None = None
    status: int = 200
    json: dict[str, Any] | None = None
    """The JSON when it is not ``data`` (a record's page: the record alone)."""


def _one(params: Mapping[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[-1].strip() or None if values else None


def _flag(params: Mapping[str, list[str]], name: str) -> bool:
    """A yes/no query parameter: ``1``, ``true``, ``yes`` or ``on`` (any case) is yes."""
    return (_one(params, name) or "").lower() in ("1", "true", "yes", "on")


def _instant(text: str, name: str) -> int:
    """Epoch milliseconds (up to year 9999) or ISO 8601 (a time without a zone is UTC)."""
    digits = text.removeprefix("-")
    if digits.isascii() and digits.isdigit():
        if len(digits) > len(str(MAX_MS)) or abs(int(text)) > MAX_MS:
            raise InvalidInput(f"{text!r} is beyond the epoch milliseconds of year 9999", field=name)
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return int(moment.timestamp() * 1000)
    except (ValueError, OverflowError):
        raise InvalidInput(f"{text!r} is neither epoch milliseconds nor an ISO 8601 time", field=name) from None


class StatusPage:
    """The ``app`` of :class:`~wowd.daemon.http.HttpServer`: answers ``/ui`` and ``/api/v1``."""

    def __init__(
        self,
        settings: WowdSettings,
        backend: Backend,
        *,
        local: LocalSlots | None = None,
        window: MetricWindow | None = None,
    ) -> None:
        self._settings = settings
        self._backend = backend
        self._local = local
        self._window = window or MetricWindow()
        self._token = settings.ui.token.get_secret_value() if settings.ui.token is not None else None
        self._open_bodies = settings.ui.open_bodies
        self._tries = TokenTries()
        self._refusals = RateLimitedLog(log)
        self._form_key = secrets.token_hex(32)
        self._secrets = secret_values(settings)
        self._css = files("wowd.ui").joinpath("static/style.css").read_bytes()
        self._env: jinja2.Environment | None = None
        self._get: dict[str, Callable[[dict[str, list[str]]], Awaitable[_Out]]] = {
            "overview": self._overview,
            "status": self._status,
            "timers": self._timers,
            "timer": self._timer,
            "quarantine": self._quarantine,
            "outbox": self._outbox,
            "outbox/entry": self._outbox_entry,
        }

    def _templates(self) -> jinja2.Environment:
        """The pages' templates and filters, made at the first page (a replica nobody browses
        does not load the template engine)."""
        if self._env is not None:
            return self._env
        import jinja2

        env = jinja2.Environment(
            loader=jinja2.PackageLoader("wowd.ui", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        env.filters["iso"] = lambda ms: iso_ms(ms) if isinstance(ms, int) else "-"
        env.filters["at"] = lambda ms: at(ms) if isinstance(ms, int) else "-"
        env.filters["span"] = lambda ms: span(int(ms)) if isinstance(ms, int | float) else "-"
        env.filters["seconds"] = lambda s: "-" if s is None else (f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s")
        env.filters["json"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
        env.filters["query"] = lambda d: urlencode({k: v for k, v in d.items() if v not in (None, "")})
        self._env = env
        return env

    # ------------------------------------------------------------------ dispatch

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        path, _, query = request.target.partition("?")
        api = path.startswith("/api/v1")
        name = path.removeprefix("/api/v1" if api else "/ui").strip("/")
        if not api and not path.startswith("/ui"):
            return self._text(404, "not found\n")
        if not api and path == "/ui/static/style.css":
            return HttpResponse(200, "text/css; charset=utf-8", self._css, SECURITY_HEADERS)
        if not api and name == "":
            name = "overview"
        params = parse_qs(query)
        reader = self._open_bodies
        extra: tuple[tuple[str, str], ...] = ()
        try:
            if request.method in ("GET", "HEAD"):
                offered = offered_token(request)
                if name == "login":
                    return self._login(request, offered, params)
                if offered is not None and self._token is not None:
                    basic = request.headers.get("authorization", "").lstrip().lower().startswith("basic")
                    self._check_token(request, offered, basic=basic)
                    reader = True
                out = await self._read(name, params)
            elif request.method == "POST":
                form = self._form(request, api)
                self._authorize(request, form, api)
                out = await self._act(name, params, form, request.client or "an unknown client")
                if not api:
                    return HttpResponse(303, HTML, b"", (("location", self._back(name, out)), *SECURITY_HEADERS))
            else:
                return self._text(405, "method not allowed\n")
        except _NotFound as exc:
            out = _Out({"error": str(exc)}, "error.html", 404)
        except _Refused as exc:
            UI_REFUSED.labels(reason=exc.reason).inc()
            self._refusals.log(
                exc.reason, logging.WARNING, "ui: %s %s from %s refused: %s", request.method, path, request.client, exc
            )
            out = _Out({"error": str(exc)}, "error.html", exc.status)
            extra = exc.headers
        except (InvalidInput, ConfigError) as exc:
            UI_REFUSED.labels(reason="bad input").inc()
            out = _Out({"error": str(exc)}, "error.html", 400)
        except StorageUnavailable as exc:
            out = _Out({"error": f"the store does not answer: {exc}"}, "error.html", 503)
        except StorageError as exc:
            out = _Out({"error": f"the store refused: {type(exc).__name__}: {exc}"}, "error.html", 500)
        if not reader:
            out = _Out(hide_bodies(out.data), out.template, out.status, hide_bodies(out.json))
        headers = (*SECURITY_HEADERS, *extra)
        if api or out.template is None:
            body = json.dumps(out.json if out.json is not None else out.data, indent=2, default=str) + "\n"
            return HttpResponse(out.status, JSON, redact(body, self._secrets).encode(), headers)
        page = (
            self._templates()
            .get_template(out.template)
            .render(
                **out.data,
                page=name,
                version=__version__,
                namespace=self._settings.lease_namespace,
                context=self._settings.context,
                actions=self._token is not None,
                bodies_hidden=not reader,
                here=request.target,
                form_key=self._form_key,
                refresh=REFRESH_S if name == "overview" else None,
                statuses=[s.value for s in TimerStatus],
                ended_detail=ENDED_DETAIL,
                retention=span(self._settings.timers.tombstone_retention_s * 1000),
                attempts_kept=HISTORY_ATTEMPTS,
            )
        )
        return HttpResponse(out.status, HTML, redact(page, self._secrets).encode(), headers)

    async def _read(self, name: str, params: dict[str, list[str]]) -> _Out:
        if name in self._get:
            return await self._get[name](params)
        head, _, item = name.partition("/")
        if head == "quarantine" and item:
            return await self._quarantine_item(item)
        raise _NotFound(f"no page {name!r}")

    async def _act(self, name: str, params: dict[str, list[str]], form: dict[str, list[str]], who: str) -> _Out:
        """An action, done for the token holder at ``who`` (the client's address, which its log
        line names). Answered as the command line answers it: 200 when done, 409 when it changed
        nothing or not all it was asked (the command line's exit 1)."""
        both = {**params, **form}
        if name in ("timer/retry", "timer/resume"):
            return await self._repair(both, TimerStatus.FAILED if name == "timer/retry" else TimerStatus.PARKED, who)
        if name == "timer/cancel":
            return await self._cancel(both, who)
        if name in ("timers/retry", "timers/resume"):
            return await self._repair_target(
                both, TimerStatus.FAILED if name == "timers/retry" else TimerStatus.PARKED, who
            )
        if name == "outbox/ack":
            return await self._ack(both, who)
        head, _, rest = name.partition("/")
        item, _, verb = rest.rpartition("/")
        if head == "quarantine" and item and verb == "refeed":
            return await self._refeed(item, who)
        if head == "quarantine" and item and verb == "dismiss":
            return await self._dismiss(item, both, who)
        raise _Refused(405, "unknown action", f"no action {name!r}")

    def _notice(self, text: str) -> dict[str, str]:
        """The query parameters that make the page after an action say ``text``."""
        return {"done": text, "sig": sign_notice(self._form_key, text)}

    def _done(self, params: Mapping[str, list[str]]) -> str | None:
        """The notice of the action just done, when this process wrote it (a link made elsewhere
        cannot make a page say what wowd did not)."""
        return signed_notice(self._form_key, _one(params, "done"), _one(params, "sig"))

    @staticmethod
    def _back(name: str, out: _Out) -> str:
        """Where a form's POST leads: the page of what it changed, saying what was done."""
        back = out.data.get("back")
        return str(back) if back else "/ui/" + name.rpartition("/")[0]

    @staticmethod
    def _text(status: int, text: str) -> HttpResponse:
        return HttpResponse(status, "text/plain; charset=utf-8", text.encode(), SECURITY_HEADERS)

    # ------------------------------------------------------------------ protection of the actions

    @staticmethod
    def _form(request: HttpRequest, api: bool) -> dict[str, list[str]]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == "application/x-www-form-urlencoded":
            try:
                return parse_qs(request.body.decode("utf-8"), strict_parsing=bool(request.body))
            except (UnicodeDecodeError, ValueError):
                raise InvalidInput(
                    "the form does not read as application/x-www-form-urlencoded", field="body"
                ) from None
        if api and ctype == "application/json" and request.body:
            try:
                doc = json.loads(request.body)
            except ValueError as exc:
                raise InvalidInput(f"not JSON: {exc}", field="body") from None
            if not isinstance(doc, dict):
                raise InvalidInput("a JSON object is expected", field="body")
            return {k: [str(x) for x in v] if isinstance(v, list) else [str(v)] for k, v in doc.items()}
        if request.body:
            raise InvalidInput(f"content type {ctype or '(none)'} is not a form", field="content-type")
        return {}

    def _authorize(self, request: HttpRequest, form: dict[str, list[str]], api: bool) -> None:
        """Refuses a POST without the token, from another site, or (a form) without the page's key."""
        if self._token is None:
            raise _Refused(403, "read-only", "the status page is read-only: ui.token (WOWD_UI__TOKEN) is not set")
        fetch_site = request.headers.get("sec-fetch-site")
        if fetch_site is not None and fetch_site not in ("same-origin", "none"):
            raise _Refused(403, "cross-site", f"refused: a {fetch_site} request (Sec-Fetch-Site)")
        origin = request.headers.get("origin")
        if origin is not None:
            host = request.headers.get("host", "")
            parts = urlsplit(origin)
            if origin == "null" or parts.netloc != host:
                raise _Refused(403, "cross-site", f"refused: Origin {origin} is not this listener ({host})")
        if api:
            given = offered_token(request) or ""
        else:
            given = (form.get("token") or [""])[-1]
            key = (form.get("form_key") or [""])[-1]
            if not compare(key, self._form_key):
                raise _Refused(403, "form key", "refused: the form's key is not this page's (reload the page)")
        self._check_token(request, given, basic=False)

    def _check_token(self, request: HttpRequest, given: str, *, basic: bool) -> None:
        """Refuses a wrong token (401 asking a browser again when it came as HTTP Basic, else
        403), and any token from a client that offered too many wrong ones lately (429)."""
        assert self._token is not None
        wait = self._tries.wait_s(request.client)
        if wait > 0:
            after = TokenTries.retry_after(wait)
            raise _Refused(
                429,
                "too many tries",
                f"refused: too many wrong tokens from {request.client or 'this client'}; try again in {after} s",
                (("retry-after", after),),
            )
        if not compare(given, self._token):
            self._tries.failed(request.client)
            if basic:
                raise _Refused(401, "token", "refused: wrong token", (("www-authenticate", _ASK_TOKEN),))
            raise _Refused(403, "token", "refused: wrong or missing token")

    def _login(self, request: HttpRequest, offered: str | None, params: Mapping[str, list[str]]) -> HttpResponse:
        """``/ui/login?next=PAGE``: asks a browser for the token (HTTP Basic: any user name, the
        token as the password), then leads to ``PAGE`` (a page of ``/ui``), where command bodies
        are shown to it from then on."""
        wanted = _one(params, "next") or "/ui"
        back = wanted if _PAGE_OF_UI.fullmatch(wanted) else "/ui"
        if self._token is None:
            raise _Refused(
                403,
                "read-only",
                "no token is set (ui.token, WOWD_UI__TOKEN): command bodies are shown to nobody here, unless "
                "ui.open_bodies shows them to anyone",
            )
        if offered is None:
            raise _Refused(
                401,
                "sign in",
                "the token is asked for: any user name, the token as the password",
                (("www-authenticate", _ASK_TOKEN),),
            )
        self._check_token(request, offered, basic=True)
        return HttpResponse(303, HTML, b"", (("location", back), *SECURITY_HEADERS))

    # ------------------------------------------------------------------ overview

    async def _status(self, params: dict[str, list[str]]) -> _Out:
        return _Out(await read_status(self._settings, self._backend))

    def _process(self) -> dict[str, Any]:
        """This process's part: the slots it holds (each view's feed lag, the watermark's age,
        the stalls) and its delivery metrics over the window."""
        from wowd import metrics

        lag: dict[str, dict[str, float]] = {}
        for family in metrics.FEED_LAG.collect():
            for sample in family.samples:
                lag.setdefault(sample.labels["slot"], {})[sample.labels["view"]] = sample.value
        watermark = _gauge(metrics.FEED_WATERMARK_LAG)
        held = dict(self._local()) if self._local is not None else {}
        slots = {
            str(slot): {
                "feed_lag_s": lag.get(str(slot), {}),
                "watermark_age_s": watermark.get(str(slot)),
                "stalled": why,
            }
            for slot, why in sorted(held.items())
        }
        return {
            "owner_key": self._settings.owner_key,
            "slots": slots,
            "delivery": delivery_doc(self._settings),
            **self._window.read(),
        }

    async def _overview(self, params: dict[str, list[str]]) -> _Out:
        status = await read_status(self._settings, self._backend)
        return _Out({"status": status, "process": self._process()}, "overview.html")

    # ------------------------------------------------------------------ timers

    def _owner(self, params: Mapping[str, list[str]]) -> Any:
        text = _one(params, "owner")
        if text is None:
            return None
        return parse_ref(text, context=self._settings.context, tenant=_one(params, "tenant"))

    async def _timers(self, params: dict[str, list[str]]) -> _Out:
        form = {
            k: _one(params, k)
            for k in ("owner", "tenant", "key", "status", "target", "due_from", "due_until", "request_id")
        }
        if form["request_id"] is not None:
            return await self._by_request(form)
        owner = self._owner(params)
        if form["key"] is not None and owner is None:
            raise InvalidInput("a key names a timer of an owner: give the owner too", field="key")
        status_text = form["status"]
        try:
            status = TimerStatus(status_text.upper()) if status_text else None
        except ValueError:
            raise InvalidInput(f"{status_text!r} is not a timer status", field="status") from None
        target_text = form["target"]
        target = parse_ref(target_text, context=self._settings.context, tenant=form["tenant"]) if target_text else None
        after_text = _one(params, "after")
        query = TimerSearch(
            owners=owner_streams(owner) if owner is not None else (),
            key=form["key"] if owner is not None else None,
            status=status,
            target=target,
            due_from=_instant(form["due_from"], "due_from") if form["due_from"] else None,
            due_until=_instant(form["due_until"], "due_until") if form["due_until"] else None,
            after=parse_cursor(after_text) if after_text else None,
        )
        page = await search_timers(self._backend.timer_queries, query, PAGE)
        now = int(time.time() * 1000)
        docs = [{**timer_doc(t), "detail": detail(t, now)} for t in page.timers]
        rows = [{**d, "owner_ref": _ref_params(t.owner)} for d, t in zip(docs, page.timers, strict=True)]
        data = {"timers": rows, "next": page.next, "search": form, "done": self._done(params), "history": []}
        return _Out(data, "timers.html", json={"timers": docs, "next": page.next})

    async def _load(self, params: Mapping[str, list[str]]) -> Any:
        owner = self._owner(params)
        key = _one(params, "key")
        if owner is None or key is None:
            raise InvalidInput("a timer is named by its owner (AGGREGATE/ID) and its key", field="owner")
        return owner, key, await find_timer(self._backend.timer_queries, owner, key)

    async def _view(self, params: Mapping[str, list[str]]) -> tuple[str, TimerHistoryView | None]:
        """The timer the parameters name (``timer_id``, ``request_id``, or ``owner`` and ``key``)
        with its history, and how to name it in a message."""
        timer_id, request_id = _one(params, "timer_id"), _one(params, "request_id")
        if request_id is not None:
            return f"with request id {request_id}", await timer_history(self._backend, request_id=request_id)
        if timer_id is not None:
            return timer_id, await timer_history(self._backend, timer_id=timer_id)
        owner, key = self._owner(params), _one(params, "key")
        if owner is None or key is None:
            raise InvalidInput(
                "a timer is named by its owner (AGGREGATE/ID) and its key, its timer_id or a request_id", field="owner"
            )
        return f"{key!r} of {owner}", await timer_history(self._backend, owner=owner, key=key)

    async def _timer(self, params: dict[str, list[str]]) -> _Out:
        name, view = await self._view(params)
        done = self._done(params)
        if view is None:
            days = self._settings.timers.tombstone_retention_s / 86400
            gone = (
                f"no timer {name}: none is live, and none fired or was cancelled in the last {days:g} days (or its "
                "schedule is not fed yet)"
            )
            if done is not None:  # back from an action: the timer may have fired since
                return _Out({"error": gone, "done": done}, "error.html", 404)
            raise _NotFound(gone)
        history = [history_doc(r) for r in view.records]
        shown = [{**_HISTORY_BLANK, **h} for h in history]  # every field, for the template
        t = view.timer
        if t is None:
            doc: dict[str, Any] = {
                "timer_id": view.timer_id,
                "status": view.state,
                "owner": str(view.owner),
                "key": view.key,
                "history": history,
            }
            page = {**doc, "history": shown, "live": False, "owner_ref": _ref_params(view.owner)}
            return _Out({"timer": page, "done": done}, "timer.html", json=doc)
        doc = {**timer_doc(t), "detail": detail(t), "owner_ref": _ref_params(t.owner)}
        doc["scheduled_by"] = f"{t.owner} v{t.version}"
        doc["slot"] = await self._slot_of(t.partition)
        page = {**doc, "history": shown, "live": True}
        return _Out({"timer": page, "done": done}, "timer.html", json={**doc, "history": history})

    async def _by_request(self, form: dict[str, str | None]) -> _Out:
        """The search by request id: the timer that sent it (or whose commit carried it), live or
        ended, with its history; no other timer."""
        assert form["request_id"] is not None
        view = await timer_history(self._backend, request_id=form["request_id"])
        docs: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        history: list[dict[str, Any]] = []
        if view is not None:
            history = [history_doc(r) for r in view.records]
            t = view.timer
            if t is not None:
                docs = [{**timer_doc(t), "detail": detail(t)}]
            else:
                ended = ENDED_DETAIL[view.state]
                docs = [{"timer_id": view.timer_id, "status": view.state, "owner": str(view.owner), "key": view.key,
                         "detail": ended}]  # fmt: skip
            rows = [{**docs[0], "owner_ref": _ref_params(view.owner), "live": t is not None}]
        data = {"timers": rows, "next": None, "search": form, "history": history, "done": None}
        return _Out(data, "timers.html", json={"timers": docs, "next": None, "history": history})

    async def _slot_of(self, part: int) -> dict[str, Any]:
        """The slot of a partition, whether it has a live holder and, held here, its stall."""
        s = self._settings
        slot = s.lease.slot_offset + part % s.lease.limit
        state = next((st for st in await self._backend.leases.slots(s.lease_namespace) if st.slot == slot), None)
        held = dict(self._local()) if self._local is not None else {}
        return {
            "slot": slot,
            "holder": state.owner_key if state is not None and state.live else None,
            "fence": state.fence if state is not None else 0,
            "stalled": held.get(slot),
        }

    async def _repair(self, params: dict[str, list[str]], wanted: TimerStatus, who: str) -> _Out:
        owner, key, t = await self._load(params)
        if t is None:
            raise _NotFound(f"no live timer {key!r} of {owner}")
        if t.status is not wanted:
            raise InvalidInput(f"the timer is {t.status.value}, not {wanted.value}", field="status")
        written = await repair_timers(self._backend.firing, [t])
        verb = "retried" if wanted is TimerStatus.FAILED else "resumed"
        log.info(
            "ui: timer %r of %s %s by the token holder at %s (%s -> PENDING, due now)%s",
            t.key,
            t.owner,
            verb,
            who,
            wanted.value,
            "" if written else ": not changed, it moved on meanwhile",
        )
        done = f"{verb}: back to PENDING, due now" if written else "not changed: the timer moved on meanwhile"
        back = "/ui/timer?" + urlencode({**_ref_params(t.owner), "key": t.key, **self._notice(done)})
        after = await find_timer(self._backend.timer_queries, t.owner, t.key)  # the timer as it is now
        doc = {"written": written, "timer": timer_doc(after) if after is not None else None, "back": back}
        return _Out(doc, status=200 if written else 409)

    async def _cancel(self, params: dict[str, list[str]], who: str) -> _Out:
        """Appends the cancel of a live timer to the stream that holds it (as ``wowd timers
        cancel`` does); the feed then ends it."""
        from wowd.client import SCHEDULES, WowdClient

        owner, key, t = await self._load(params)
        if t is None:
            raise _NotFound(f"no live timer {key!r} of {owner}: nothing to cancel")
        s = self._settings.timers
        client = WowdClient(self._backend.log, max_body_bytes=s.max_body_bytes, min_interval_ms=s.min_interval_ms)
        commit = await client.cancel(t.owner, t.key, in_owner_stream=t.owner.aggregate != SCHEDULES)
        log.info(
            "ui: timer %r of %s cancelled by the token holder at %s (commit %s v%d)",
            t.key,
            t.owner,
            who,
            commit.ref,
            commit.version,
        )
        done = f"cancel appended ({commit.ref} v{commit.version}): the timer ends once the feed applies it"
        back = "/ui/timer?" + urlencode({**_ref_params(t.owner), "key": t.key, **self._notice(done)})
        return _Out({"cancelled": t.timer_id, "commit": f"{commit.ref} v{commit.version}", "back": back})

    async def _repair_target(self, params: dict[str, list[str]], wanted: TimerStatus, who: str) -> _Out:
        """Every FAILED (``retry``) or PARKED (``resume``) timer of one target back to PENDING, due
        now (as ``wowd timers retry|resume --target`` does)."""
        text = _one(params, "target")
        if text is None:
            raise InvalidInput("which target's timers: target (AGGREGATE/ID)", field="target")
        target = parse_ref(text, context=self._settings.context, tenant=_one(params, "tenant"))
        page = await search_timers(self._backend.timer_queries, TimerSearch(status=wanted, target=target), BULK_CAP)
        written = await repair_timers(self._backend.firing, page.timers)
        verb = "retried" if wanted is TimerStatus.FAILED else "resumed"
        log.info(
            "ui: %d of the %s timers of target %s %s by the token holder at %s",
            written,
            wanted.value,
            target,
            verb,
            who,
        )
        more = " (more remain: again)" if page.next is not None else ""
        done = f"{written} {wanted.value} timer(s) of {target} {verb}: back to PENDING, due now{more}"
        back = "/ui/timers?" + urlencode({"status": wanted.value, "target": text, **self._notice(done)})
        status = 200 if written == len(page.timers) else 409
        return _Out(
            {"written": written, "asked": len(page.timers), "more": page.next is not None, "back": back}, status=status
        )

    # ------------------------------------------------------------------ quarantine

    async def _quarantine(self, params: dict[str, list[str]]) -> _Out:
        dismissed = _flag(params, "dismissed")
        items, nxt = await quarantine_page(self._backend.quarantine, _one(params, "after"), PAGE, dismissed=dismissed)
        rows = [{**i, "record": record_of(i)} for i in items]
        data = {"items": rows, "next": nxt, "done": self._done(params), "dismissed": dismissed}
        return _Out(data, "quarantine.html", json={"items": items, "next": nxt})

    async def _quarantine_item(self, item_id: str) -> _Out:
        item = await quarantined_item(self._backend.quarantine, item_id)
        if item is None:
            raise _NotFound(f"no quarantined item {item_id} (released, or never quarantined)")
        steps = list(steps_needed(str(item.get("reason", ""))))
        return _Out({"item": item, "record": record_of(item), "steps": steps}, "quarantine_item.html", json=item)

    async def _refeed(self, item_id: str, who: str) -> _Out:
        item = await quarantined_item(self._backend.quarantine, item_id)
        if item is None:
            raise _NotFound(f"no quarantined item {item_id}")
        outcome = await retry_item(self._settings, self._backend, item)
        log.info(
            "ui: quarantined item %s re-fed by the token holder at %s: %s",
            item_id,
            who,
            f"still quarantined: {outcome.reason}" if outcome.reason else "released",
        )
        doc = {"item_id": outcome.item_id, "record": outcome.record, "done": outcome.done, "reason": outcome.reason}
        if outcome.reason is None:
            doc["back"] = "/ui/quarantine?" + urlencode(
                self._notice(f"{item_id} fed ({', '.join(outcome.done)}) and released")
            )
        else:
            doc["back"] = f"/ui/quarantine/{item_id}"
        return _Out(doc, status=200 if outcome.reason is None else 409)

    async def _dismiss(self, item_id: str, params: dict[str, list[str]], who: str) -> _Out:
        """Dismisses a quarantined commit that will never apply, with the reason given (as ``wowd
        quarantine dismiss`` does); kept for audit, out of the listing."""
        reason = _one(params, "reason") or ""  # stripped
        refused = await dismiss_item(self._backend.quarantine, item_id, reason, f"the token holder at {who}")
        if refused is not None:
            if not refused.found:
                raise _NotFound(refused.why)
            return _Out({"item_id": item_id, "dismissed": False, "reason": refused.why}, status=409)
        log.info("ui: quarantined item %s dismissed by the token holder at %s: %s", item_id, who, reason)
        back = "/ui/quarantine?" + urlencode(self._notice(f"{item_id} dismissed: {reason}"))
        return _Out({"item_id": item_id, "dismissed": True, "back": back})

    # ------------------------------------------------------------------ outbox

    def _offset(self, params: Mapping[str, list[str]]) -> int:
        text = _one(params, "offset") or "0"
        if not (text.isascii() and text.isdigit()) or len(text) > MAX_OFFSET_DIGITS:
            raise InvalidInput(
                f"{text!r} is not an offset (0, 1, ... with at most {MAX_OFFSET_DIGITS} digits)", field="offset"
            )
        return int(text)

    async def _outbox(self, params: dict[str, list[str]]) -> _Out:
        offset = self._offset(params)
        entries, nxt = await outbox_page(self._backend.outbox, offset, PAGE)
        depth = await self._backend.outbox.count()
        docs = [{**outbox_entry_doc(e), "offset": offset + i} for i, e in enumerate(entries)]
        doc = {"entries": docs, "next": nxt, "offset": offset, "depth": depth}
        return _Out({**doc, "done": self._done(params)}, "outbox.html", json=doc)

    async def _outbox_entry(self, params: dict[str, list[str]]) -> _Out:
        """The entry of ``request_id``, looked for around ``offset`` (where the list showed it;
        entries acknowledged since move it up)."""
        wanted = _one(params, "request_id")
        if wanted is None:
            raise InvalidInput("which entry: request_id", field="request_id")
        offset = self._offset(params)
        start = max(0, offset - PAGE)
        entries, _ = await outbox_page(self._backend.outbox, start, 2 * PAGE)
        for i, e in enumerate(entries):
            if e.request_id == wanted:
                doc = {**outbox_entry_doc(e), "offset": start + i}
                return _Out({"entry": doc}, "outbox_entry.html", json=doc)
        raise _NotFound(f"no outbox entry {wanted} near offset {offset} (acknowledged, or trimmed)")

    async def _ack(self, params: dict[str, list[str]], who: str) -> _Out:
        ids = [i for i in [*params.get("request_id", []), *params.get("request_ids", [])] if i.strip()]
        if not ids:
            raise InvalidInput("no entry chosen (request_id)", field="request_id")
        removed = await self._backend.outbox.ack(ids)
        log.info("ui: %d of %d outbox entries acknowledged by the token holder at %s", removed, len(set(ids)), who)
        done = f"{removed} of {len(set(ids))} entries acknowledged (removed)"
        doc = {"removed": removed, "asked": len(set(ids)), "back": "/ui/outbox?" + urlencode(self._notice(done))}
        return _Out(doc, status=200 if removed == len(set(ids)) else 409)


_HISTORY_BLANK = dict.fromkeys(
    ("scheduled_at", "position", "outcome", "status", "latency_ms", "reason", "answer", "expires_at")
)
"""The fields a history record's document may leave out."""


def _ref_params(ref: Any) -> dict[str, str]:
    """The query parameters that name an aggregate (``owner``, ``tenant``: empty for the default)."""
    return {
        "owner": f"{ref.context}.{ref.aggregate}/{ref.id}",
        "tenant": "" if ref.tenant_id == DEFAULT_TENANT else ref.tenant_id,
    }


def _gauge(metric: Any) -> dict[str, float]:
    """A gauge's values by its ``slot`` label."""
    return {s.labels["slot"]: s.value for family in metric.collect() for s in family.samples if "slot" in s.labels}
