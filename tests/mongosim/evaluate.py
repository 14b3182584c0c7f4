"""Query semantics: mongomock's evaluator of filters, update operators, sorts and aggregation
stages, plus what it lacks and wowd sends, each following its manual page.

Additions (mongomock 4.3 lacks them):

- ``$$NOW`` (manual, "Aggregation Variables"): the same Date for the whole command;
- ``$$REMOVE`` (same page): a field set to it is left out;
- ``$mergeObjects`` as an expression (manual, "$mergeObjects (aggregation)"): later documents
  win, ``null`` arguments are ignored;
- ``$toLong`` and ``$toDate`` of a Date / of milliseconds (manual, "$toLong", "$toDate");
- ``$toString`` of numbers (manual, "$toString");
- the stages ``$replaceWith`` (manual, "$replaceWith"), ``$unset`` (manual, "$unset
  (aggregation)"), ``$unionWith`` (manual, "$unionWith": the sub-pipeline's documents after the
  input's, a missing collection reads as empty);
- update pipelines (manual, "Updates with Aggregation Pipeline"): only ``$addFields``/``$set``,
  ``$project``/``$unset``, ``$replaceRoot``/``$replaceWith`` (another stage: code 72, "... is not
  allowed to be used within an update");
- comparison expressions in BSON order across types, a missing field below null (manual,
  "Comparison/Sort Order"); ``$add`` of a Date and milliseconds (manual, "$add");
- ``$type`` of an array of types (manual, "$type": "Querying by Multiple Data Types");
- ``$not`` of its one-element argument array (manual, "$not (aggregation)": ``{$not:
  [<expression>]}`` is true when the expression is false, null, 0 or missing; mongomock negates
  the array itself, always false).

Everything else is mongomock's; what it does not implement raises, and the engine answers an
error (never a silent success).
"""

from __future__ import annotations

import contextvars
import copy
import datetime
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mongomock
from bson.int64 import Int64
from bson.max_key import MaxKey
from bson.min_key import MinKey
from bson.objectid import ObjectId
from mongomock import aggregate as mm_aggregate
from mongomock import filtering, helpers
from sentinels import NOTHING

__all__ = [
    "NOW",
    "UPDATE_STAGES",
    "Failure",
    "run_pipeline",
    "sort_docs",
]


class Failure(Exception):
    """A server error: ``code`` and the message the server gives."""

    def __init__(self, code: int, message: str, *, labels: Sequence[str] = (), extra: Mapping[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.labels = list(labels)
        self.extra = dict(extra or {})


NOW: contextvars.ContextVar[datetime.datetime] = contextvars.ContextVar("mongosim_now")
"""``$$NOW`` of the command being run (set by the engine per command)."""

REMOVE = object()

_BaseParser = mm_aggregate._Parser


class _Parser(_BaseParser):  # type: ignore[misc,valid-type]
    """mongomock's expression parser with the additions listed in the module docstring."""

    def parse(self, expression: Any) -> Any:
        if isinstance(expression, dict) and len(expression) == 1:
            ((op, value),) = expression.items()
            if op == "$mergeObjects":
                values = value if isinstance(value, list) else [value]
                out: dict[str, Any] = {}
                for v in values:
                    parsed = self._parse_or_nothing(v)
                    if parsed is NOTHING or parsed is None:
                        continue
                    if not isinstance(parsed, dict):
                        raise mongomock.OperationFailure(
                            f"$mergeObjects requires object inputs, but input {parsed!r} is of type "
                            f"{type(parsed).__name__}"
                        )
                    out.update(parsed)
                return out
            if op == "$not":
                arg = value[0] if isinstance(value, list) and len(value) == 1 else value
                v = self._parse_or_missing(arg)
                return v is MISSING or v is None or v is False or (isinstance(v, int | float) and v == 0)
            if op == "$add" and isinstance(value, list):
                args = [self.parse(v) for v in value]
                dates = [a for a in args if isinstance(a, datetime.datetime)]
                if dates:
                    # a Date plus milliseconds is a Date (manual, "$add": one argument may be a Date)
                    if len(dates) > 1:
                        raise mongomock.OperationFailure("only one date allowed in an $add expression")
                    if any(a is None for a in args):
                        return None
                    ms = sum(a for a in args if not isinstance(a, datetime.datetime))
                    return dates[0] + datetime.timedelta(milliseconds=ms)
            if op in _COMPARISONS and isinstance(value, list) and len(value) == 2:
                # aggregation comparisons order values of any types as BSON does, a missing
                # field below null (manual, "Comparison Expression Operators" and "Comparison/Sort
                # Order"); mongomock raises KeyError on a missing field
                a, b = (_Ordered(self._parse_or_missing(v)) for v in value)
                cmp = -1 if a < b else 1 if b < a else 0
                return cmp if op == "$cmp" else _COMPARISONS[op](cmp)
            if op in ("$toLong", "$toDate", "$toString"):
                v = self.parse(value[0] if isinstance(value, list) and len(value) == 1 else value)
                if op == "$toLong" and isinstance(v, datetime.datetime):
                    return _ms(v)
                if op == "$toDate":
                    if v is None or isinstance(v, datetime.datetime):
                        return v
                    if isinstance(v, int | float) and not isinstance(v, bool):
                        return datetime.datetime(1970, 1, 1) + datetime.timedelta(milliseconds=int(v))
                    raise mongomock.OperationFailure(f"Unsupported conversion from {type(v).__name__} to date")
                if op == "$toString" and isinstance(v, int | float) and not isinstance(v, bool):
                    return str(v)
                return super().parse({op: value})
        return super().parse(expression)

    def _parse_or_missing(self, expression: Any) -> Any:
        try:
            return self.parse(expression)
        except KeyError:
            return MISSING

    def _parse_basic_expression(self, expression: Any) -> Any:
        if expression == "$$NOW":
            return NOW.get()
        if expression == "$$REMOVE":
            raise KeyError("$$REMOVE")  # mongomock leaves a field whose value is missing out
        if isinstance(expression, str) and expression.startswith("$$"):
            name = expression[2:].split(".")[0]
            if name not in ("ROOT", "CURRENT") and name not in self._user_vars:
                raise mongomock.OperationFailure(f"Use of undefined variable: {name}")
        return super()._parse_basic_expression(expression)


MISSING = object()
"""A missing field inside an expression (sorts below null)."""
_COMPARISONS: dict[str, Callable[[int], bool]] = {
    "$eq": lambda c: c == 0,
    "$ne": lambda c: c != 0,
    "$lt": lambda c: c < 0,
    "$lte": lambda c: c <= 0,
    "$gt": lambda c: c > 0,
    "$gte": lambda c: c >= 0,
    "$cmp": lambda c: c == 0,
}


class _Ordered:
    """A value in BSON order: MinKey < missing < null < ... < MaxKey (cross-type by type)."""

    __slots__ = ("v",)

    def __init__(self, v: Any) -> None:
        self.v = v

    def _rank(self) -> int:
        if self.v is MISSING:
            return -1
        if isinstance(self.v, MinKey):
            return -2
        if isinstance(self.v, MaxKey):
            return 1000
        return 0

    def __lt__(self, other: _Ordered) -> bool:
        a, b = self._rank(), other._rank()
        if a or b:
            return a < b
        return bool(filtering.bson_compare(operator.lt, self.v, other.v))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ordered) and not self < other and not other < self

    def __hash__(self) -> int:
        return 0


def _ms(d: datetime.datetime) -> int:
    if d.tzinfo is not None:
        d = d.astimezone(datetime.UTC).replace(tzinfo=None)
    return int((d - datetime.datetime(1970, 1, 1)) / datetime.timedelta(milliseconds=1))


mm_aggregate._Parser = _Parser  # every mongomock stage evaluates expressions through it


def _type_of_any(doc_val: Any, search_val: Any) -> bool:
    """``$type`` of one type or of an array of types (manual, "$type": "Querying by Multiple
    Data Types": the field matches when its type is any of them); mongomock takes one."""
    if isinstance(search_val, list):
        return any(filtering._type_op(doc_val, t) for t in search_val)
    return bool(filtering._type_op(doc_val, search_val))


filtering._filterer_inst._operator_map["$type"] = _type_of_any


def sort_docs(docs: list[dict[str, Any]], spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``docs`` in the order of the sort ``spec`` (mongomock's BSON ordering, stable)."""
    out = list(docs)
    for key, direction in reversed(list(spec.items())):
        if direction not in (1, -1):
            raise Failure(15975, "$sort key ordering must be 1 (for ascending) or -1 (for descending)")
        out.sort(key=lambda d, k=key: filtering.resolve_sort_key(k, d), reverse=direction < 0)
    return out


Lookup = Callable[[str, Mapping[str, Any] | None], list[dict[str, Any]]]
"""The documents of a collection of the command's database that may match a filter (all of them
for None; ``[]`` when it does not exist): never copies, never modified."""
Source = list[dict[str, Any]] | Callable[[Mapping[str, Any] | None], list[dict[str, Any]]]

STAGES = {
    "$match",
    "$sort",
    "$limit",
    "$skip",
    "$project",
    "$addFields",
    "$set",
    "$unset",
    "$count",
    "$group",
    "$replaceRoot",
    "$replaceWith",
    "$unionWith",
    "$facet",
    "$unwind",
    "$lookup",
}
"""The stages the simulator runs (an unknown name is 40324, a known one not here is refused)."""
KNOWN_STAGES = STAGES | {
    "$bucket",
    "$bucketAuto",
    "$changeStream",
    "$changeStreamSplitLargeEvent",
    "$collStats",
    "$currentOp",
    "$densify",
    "$documents",
    "$fill",
    "$geoNear",
    "$graphLookup",
    "$indexStats",
    "$listLocalSessions",
    "$listSessions",
    "$merge",
    "$out",
    "$planCacheStats",
    "$redact",
    "$sample",
    "$search",
    "$searchMeta",
    "$setWindowFields",
    "$sortByCount",
}
UPDATE_STAGES = {"$addFields", "$set", "$project", "$unset", "$replaceRoot", "$replaceWith"}
"""The stages an update pipeline may hold (manual, "Updates with Aggregation Pipeline")."""


def check_stage(stage: Any) -> tuple[str, Any]:
    if not isinstance(stage, dict) or len(stage) != 1:
        raise Failure(40323, "A pipeline stage specification object must contain exactly one field.")
    ((name, spec),) = stage.items()
    if name not in KNOWN_STAGES:
        raise Failure(40324, f"Unrecognized pipeline stage name: '{name}'")
    if name not in STAGES:
        raise Failure(2, f"mongosim does not implement the stage {name} (it answers an error, not a guess)")
    return name, spec


def run_pipeline(
    source: Source, pipeline: Sequence[Any], lookup: Lookup, *, checked: bool = False
) -> list[dict[str, Any]]:
    """``pipeline`` over the documents of ``source`` (a list, or a function answering those that
    may match a leading ``$match``), deep-copied after that ``$match``: the additions here, every
    other stage mongomock's. ``checked``: the leading ``$match``'s operators were checked
    already (a change stream's, once when it was opened)."""
    if pipeline and isinstance(pipeline[0], dict) and set(pipeline[0]) == {"$match"}:
        flt = pipeline[0]["$match"]
        if not checked:
            check_filter(flt)
        candidates = source if isinstance(source, list) else source(flt)
        docs = select(flt, candidates)
        pipeline = pipeline[1:]
    else:
        docs = source if isinstance(source, list) else source(None)
    out = [copy.deepcopy(d) for d in docs]
    for stage in pipeline:
        name, spec = check_stage(stage)
        out = _stage(out, name, spec, lookup)
    return out


def _stage(docs: list[dict[str, Any]], name: str, spec: Any, lookup: Lookup) -> list[dict[str, Any]]:
    if name == "$unionWith":
        if isinstance(spec, str):
            coll, sub = spec, []
        elif isinstance(spec, dict) and set(spec) <= {"coll", "pipeline"} and "coll" in spec:
            coll, sub = spec["coll"], spec.get("pipeline", [])
        else:
            raise Failure(40415, f"BSON field '$unionWith' is invalid: {spec!r}")
        return docs + run_pipeline(lambda f: lookup(coll, f), sub, lookup)
    if name == "$replaceWith":
        return _stage(docs, "$replaceRoot", {"newRoot": spec}, lookup)
    if name == "$unset":
        fields = [spec] if isinstance(spec, str) else spec
        if not isinstance(fields, list) or not fields or not all(isinstance(f, str) for f in fields):
            raise Failure(31002, "$unset specification must be a string or an array of strings")
        for d in docs:
            for f in fields:
                _unset(d, f.split("."))
        return docs
    if name == "$sort":
        return sort_docs(docs, spec)
    if name == "$limit":
        if not isinstance(spec, int) or isinstance(spec, bool) or spec <= 0:
            raise Failure(15958, "the limit must be positive")
        return docs[:spec]
    if name == "$facet":
        return [{k: run_pipeline(docs, p, lookup) for k, p in spec.items()}]
    if name == "$match":
        for key in _operators(spec):
            if key not in FILTER_OPERATORS:
                raise Failure(2, f"unknown operator: {key}")
    handler = mm_aggregate._PIPELINE_HANDLERS[name]
    result = list(handler(docs, _NoDatabase(lookup), spec))
    return result


class _NoDatabase:
    """What a mongomock stage gets as its database (``$lookup`` reads a collection through it)."""

    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup

    def get_collection(self, name: str) -> Any:
        raise Failure(2, "mongosim: $lookup/$out are not implemented")


def _unset(doc: Any, path: list[str]) -> None:
    if not isinstance(doc, dict):
        return
    if len(path) == 1:
        doc.pop(path[0], None)
    elif path[0] in doc:
        value = doc[path[0]]
        for v in value if isinstance(value, list) else [value]:
            _unset(v, path[1:])


FILTER_OPERATORS = {
    "$eq",
    "$ne",
    "$gt",
    "$gte",
    "$lt",
    "$lte",
    "$in",
    "$nin",
    "$and",
    "$or",
    "$nor",
    "$not",
    "$exists",
    "$type",
    "$regex",
    "$options",
    "$expr",
    "$elemMatch",
    "$size",
    "$all",
    "$mod",
}
"""The query operators the simulator accepts (manual, "Query and Projection Operators"): any
other ``$`` key in a filter is ``unknown operator`` (code 2), as the server answers."""


def _operators(spec: Any) -> list[str]:
    found: list[str] = []
    if isinstance(spec, dict):
        for k, v in spec.items():
            if k.startswith("$"):
                found.append(k)
                if k == "$expr":
                    continue
            found.extend(_operators(v))
    elif isinstance(spec, list):
        for v in spec:
            found.extend(_operators(v))
    return found


def check_filter(spec: Any) -> None:
    """Raises ``unknown operator`` (code 2) for a ``$`` key the simulator does not know."""
    if not isinstance(spec, dict):
        raise Failure(14, "filter must be an object")
    for key in _operators(spec):
        if key not in FILTER_OPERATORS:
            raise Failure(2, f"unknown operator: {key}")


def matches(spec: Mapping[str, Any], doc: Mapping[str, Any]) -> bool:
    return bool(filtering.filter_applies(spec, doc))


def get_path(doc: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` (``None`` when missing: how an index key reads it)."""
    try:
        value = helpers.get_value_by_dot(doc, path)
    except (KeyError, IndexError, TypeError):
        return None
    return value


_PLAIN = (str, ObjectId, type(None), int, Int64, float, bool)
_COMPLEX = object()
"""A path through an array, or a value whose comparison Python does not decide as BSON does."""


def _fast_get(doc: Mapping[str, Any], path: str) -> Any:
    cur: Any = doc
    for p in path.split("."):
        if isinstance(cur, list):
            return _COMPLEX
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    # these types' Python comparison agrees with BSON's within their own kind; any other value
    # is left to the full match
    return cur if type(cur) in _PLAIN else _COMPLEX


def _number(v: Any) -> bool:
    return type(v) in (int, Int64, float)


_RANGES: dict[str, Callable[[Any, Any], bool]] = {
    "$lt": operator.lt,
    "$lte": operator.le,
    "$gt": operator.gt,
    "$gte": operator.ge,
}


def _may_match(doc: Mapping[str, Any], path: str, cond: Any) -> bool:
    """False only when the top-level condition ``path: cond`` surely fails on ``doc``: an
    equality to a string or ObjectId, an ``$in`` of such or of numbers, a number range, each
    against a plain value at ``path`` (an array on the way, or any other type: True)."""
    got = _fast_get(doc, path)
    if got is _COMPLEX:
        return True
    if type(cond) in (str, ObjectId):
        return bool(got == cond)
    if not isinstance(cond, dict):
        return True
    for op, want in cond.items():
        if op == "$in" and isinstance(want, list) and all(type(w) in (str, ObjectId) or _number(w) for w in want):
            if got is None or type(got) is bool:
                return False
            if not any(got == w and (_number(got) == _number(w)) for w in want):
                return False
        elif op in _RANGES and _number(want) and _number(got):
            if not _RANGES[op](got, want):
                return False
    return True


_EXACT = (str, ObjectId, int, Int64)
"""Values whose equality Python decides as BSON does, within these types (no bool: ``True == 1``
in Python, not in BSON; no float: compared with the others as numbers)."""


_RANGE_OPS = {"$lt": operator.lt, "$lte": operator.le, "$gt": operator.gt, "$gte": operator.ge}


def exact_checker(flt: Mapping[str, Any]) -> Callable[[Mapping[str, Any]], bool | None] | None:
    """A fast decision of ``flt`` for the filters made only of top-level equalities to, or
    ``$in`` of, strings, ObjectIds and integers, and ranges (``$lt``, ``$lte``, ``$gt``,
    ``$gte``) of integers (the stores' lookups by key, the due reads): True or False when every
    field's value in the document is such a value too (an integer, for a range), None
    (mongomock's match decides) otherwise; None for any other filter."""
    tests: list[tuple[str, frozenset[Any] | None, list[tuple[Callable[[Any, Any], bool], int]]]] = []
    for path, cond in flt.items():
        if path.startswith("$"):
            return None
        allowed: frozenset[Any] | None = None
        ranges: list[tuple[Callable[[Any, Any], bool], int]] = []
        if isinstance(cond, dict):
            if not cond or not set(cond) <= {"$in", "$eq", *_RANGE_OPS}:
                return None
            for op, want in cond.items():
                if op in _RANGE_OPS:
                    if type(want) not in (int, Int64):
                        return None
                    ranges.append((_RANGE_OPS[op], want))
                    continue
                values = want if op == "$in" else [want]
                if not isinstance(values, list) or not all(type(v) in _EXACT for v in values):
                    return None
                allowed = frozenset(values) if allowed is None else allowed & frozenset(values)
        elif type(cond) in _EXACT:
            allowed = frozenset([cond])
        else:
            return None
        tests.append((path, allowed, ranges))

    def check(doc: Mapping[str, Any]) -> bool | None:
        for path, allowed, ranges in tests:
            got = _fast_get(doc, path)
            if type(got) not in _EXACT or ranges and type(got) not in (int, Int64):
                return None
            if allowed is not None and got not in allowed:
                return False
            if not all(compare(got, want) for compare, want in ranges):
                return False
        return True

    return check


def select(flt: Mapping[str, Any], docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The documents of ``docs`` that match ``flt``: decided by :func:`exact_checker` where it
    can, by mongomock's match otherwise (after :func:`prefilter`)."""
    exact = exact_checker(flt)
    if exact is None:
        return [d for d in prefilter(flt, docs) if matches(flt, d)]
    out = []
    for d in docs:
        decided = exact(d)
        if decided is None:
            decided = matches(flt, d)
        if decided:
            out.append(d)
    return out


def prefilter(flt: Mapping[str, Any], docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A cheap pass before mongomock's match (which decides): drops the documents a top-level
    condition surely excludes (see :func:`_may_match`)."""
    for path, cond in flt.items():
        if path.startswith("$"):
            continue
        docs = [d for d in docs if _may_match(d, path, cond)]
    return docs


def index_key(value: Any) -> tuple[str, Any] | None:
    """The key of a plain value in a field index (strings, integral numbers as one; None:
    missing or null); anything else is not indexed (None is answered as ``("null", None)``)."""
    t = type(value)
    if value is None:
        return ("null", None)
    if t is str:
        return ("s", value)
    if t in (int, Int64):
        return ("n", int(value))
    if t is float and value.is_integer():
        return ("n", int(value))
    return None


def indexable(cond: Any) -> list[tuple[str, Any]] | None:
    """The index keys a top-level condition can only match among (an equality to a string or
    integral number, an ``$in`` of those); None when it is not such a condition."""
    if isinstance(cond, dict):
        if set(cond) != {"$in"} or not isinstance(cond["$in"], list):
            return None
        values = cond["$in"]
    else:
        values = [cond]
    keys = []
    for v in values:
        k = index_key(v)
        if k is None or k[0] == "null" or type(v) is bool:
            return None
        keys.append(k)
    return keys


def field_value(doc: Mapping[str, Any], path: str) -> Any:
    """The plain value at ``path`` for a field index, or :data:`_COMPLEX` (an array on the way or
    a value not indexed: always a candidate)."""
    got = _fast_get(doc, path)
    if got is _COMPLEX:
        return _COMPLEX
    k = index_key(got)
    return _COMPLEX if k is None else k
