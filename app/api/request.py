"""The request class of the app: Litestar's, with JSON nested deeper than the decoder goes
refused as bad input (a 400 that says so) instead of an internal error."""

from __future__ import annotations

import sys

from litestar import Request

from app.api.errors import ApiError


class DocqaRequest(Request):
    async def json(self):
        try:
            return await super().json()
        except RecursionError:
            limit = sys.getrecursionlimit()  # the JSON decoder stops there
            raise ApiError(
                400,
                "malformed_json",
                f"the JSON body nests arrays or objects deeper than {limit} levels",
                limit,
            ) from None
