"""Checks of a decoded JSON request body before its model validates it, and the model's
validation, each failure a 400 naming the field (OpenAI's error body, `param` the
top-level field)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ValidationError

from kvray.router.api_error import APIError

MAX_BODY_DEPTH = 100  # objects and arrays nested in a request body (a schema's own bound is lower)
_SCALARS = {int, str, bool, type(None)}  # what cannot hold a non-finite number or nest


def check_body(body: dict) -> None:
    """Every number in the body finite (`json.loads` takes NaN and Infinity, and NaN passes
    every range check) and nothing nested past MAX_BODY_DEPTH; else a 400 naming the field.
    Walked without recursion."""
    stack: list[tuple[object, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _bad_field(path, f"{value} is not a finite number")
            continue
        if depth >= MAX_BODY_DEPTH:
            raise _bad_field(path, f"nested deeper than {MAX_BODY_DEPTH} levels")
        if isinstance(value, list) and set(map(type, value)) <= _SCALARS:
            continue  # (token ids: a long list of ints, checked at C speed)
        children = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in children:
            if isinstance(child, dict | list | float):
                where = f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))
                stack.append((child, where, depth + 1))


def _bad_field(path: str, why: str) -> APIError:
    """A 400 for the field at `path` (`a.b[2].c`), its top-level name as `param`."""
    top = path.split(".")[0].split("[")[0] or None
    shown = path if len(path) <= 80 else path[:77] + "..."
    return APIError(400, f"{shown or 'body'}: {why}", param=top, code="invalid_value")


def validate_body(model: type[BaseModel], body: dict):
    """`model` validated from `body`; a bad field is a 400 naming it in `param`."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(p) for p in err["loc"])
        raise APIError(400, f"{where}: {err['msg']}", param=param, code="invalid_value") from None
