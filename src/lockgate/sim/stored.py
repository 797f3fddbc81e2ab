"""The simulator's response store (the Responses API), as vLLM keeps one with its store enabled: the last
`MAX_STORED` responses made with `store` not false, each with its input, in this process only.

- `POST /v1/responses` with `previous_response_id`: the stored response's input and output come first in the
  conversation (`with_previous`); an id it does not hold is 404, as vLLM answers it.
- `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`; `POST
  /v1/responses/{id}/cancel` is 400 for a response that is not running in the background (none is, here).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aiohttp import web

from .wire import WireError, error_body

#: Responses kept (the oldest are dropped).
MAX_STORED = 1024


class ResponseStore:
    def __init__(self) -> None:
        self._kept: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def keep(self, response: dict[str, Any], body: dict[str, Any]) -> None:
        """Keep a finished response and the input it answered (unless its request said `store: false`)."""
        if body.get("store") is False:
            return
        items = body.get("input")
        messages = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or ())
        self._kept[response["id"]] = (response, [_as_item(m, n, response["id"]) for n, m in enumerate(messages)])
        if len(self._kept) > MAX_STORED:
            self._kept.popitem(last=False)

    def with_previous(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request's body with the conversation so far in front of its input (`previous_response_id`)."""
        previous = body.get("previous_response_id")
        if previous is None:
            return body
        kept = self._kept.get(previous) if isinstance(previous, str) else None
        if kept is None:
            raise WireError(404, f"Response with id '{previous}' not found.", "NotFoundError", "previous_response_id")
        response, messages = kept
        text = "".join(
            part.get("text", "") for item in response["output"] for part in item.get("content", ()) if "text" in part
        )
        items = body.get("input")
        now = [{"role": "user", "content": items}] if isinstance(items, str) else list(items or ())
        return {**body, "input": [*messages, {"role": "assistant", "content": text}, *now]}

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/responses/{id}", self._get)
        app.router.add_delete("/v1/responses/{id}", self._delete)
        app.router.add_get("/v1/responses/{id}/input_items", self._input_items)
        app.router.add_post("/v1/responses/{id}/cancel", self._cancel)

    def _missing(self, request: web.Request) -> web.Response:
        message = f"Response with id '{request.match_info['id']}' not found."
        return web.Response(status=404, body=error_body(404, message, "NotFoundError"), content_type="application/json")

    async def _get(self, request: web.Request) -> web.Response:
        kept = self._kept.get(request.match_info["id"])
        return web.json_response(kept[0]) if kept is not None else self._missing(request)

    async def _delete(self, request: web.Request) -> web.Response:
        kept = self._kept.pop(request.match_info["id"], None)
        if kept is None:
            return self._missing(request)
        return web.json_response({"id": kept[0]["id"], "object": "response", "deleted": True})

    async def _input_items(self, request: web.Request) -> web.Response:
        kept = self._kept.get(request.match_info["id"])
        if kept is None:
            return self._missing(request)
        query = request.query
        order, after = query.get("order", "desc"), query.get("after")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            message = "'limit' must be 1 to 100 and 'order' 'asc' or 'desc'"
            body = error_body(400, message, "BadRequestError")
            return web.Response(status=400, body=body, content_type="application/json")
        # OpenAI's paging: newest first unless `order=asc`, `limit` items after the one named `after`.
        items = kept[1] if order == "asc" else kept[1][::-1]
        if after is not None:
            ids = [item.get("id") for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        listed: dict[str, Any] = {"object": "list", "data": page, "has_more": len(items) > limit}
        listed["first_id"], listed["last_id"] = (page[0].get("id"), page[-1].get("id")) if page else (None, None)
        return web.json_response(listed)

    async def _cancel(self, request: web.Request) -> web.Response:
        if request.match_info["id"] not in self._kept:
            return self._missing(request)
        return web.Response(
            status=400,
            body=error_body(400, "Only a response running in the background can be cancelled.", "BadRequestError"),
            content_type="application/json",
        )


def _as_item(message: dict[str, Any], index: int, response_id: str) -> dict[str, Any]:
    """An input message as the store lists it (OpenAI's shape: typed, with an id, its text as `input_text` parts)."""
    if "role" not in message:
        return message
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "input_text" if message["role"] != "assistant" else "output_text", "text": content}]
    return {"type": "message", "id": f"msg_{response_id[5:]}_{index}", **message, "content": content}
