"""The server-wide byte budget of images waiting for the encoder.

A chat request's images cost memory from the moment they are decoded until the vision tower
has encoded them: the decoded picture while it is preprocessed, then the preprocessed frames
(float32, often ten times the encoded file) and the encoded bytes while the request waits in
the queue. Every such byte is charged here when it comes into being; a request whose next image
does not fit is refused (503 with Retry-After: the budget frees itself as queued requests are
encoded), one whose own images could never fit gets 400. So queued image requests cannot take
the process's memory, however many are queued.

A charge for frames ends when the frames array is freed (`weakref.finalize`): after the encoder
ran, when the request ended without reaching it, or when its preparation failed. Whatever
path a request takes, the budget counts exactly the frames still alive.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lifeline.server.errors import APIError

RETRY_AFTER_S = 1.0


class ImageBudget:
    """Bytes of images held by admitted requests before their encoding, at most `max_bytes`.
    Thread-safe: charges come from the preparing threads, releases from whichever thread drops
    the frames (the engine's, once encoded)."""

    def __init__(self, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"the image budget must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used = 0
        self.refused = 0
        """Requests refused for the budget (503) since the start."""
        self._lock = threading.RLock()  # a release may run from a collection inside a charge

    def request(self) -> RequestImages:
        """The charges of one request's images."""
        return RequestImages(self)

    def _take(self, nbytes: int, own: int) -> None:
        with self._lock:
            if self.used + nbytes <= self.max_bytes:
                self.used += nbytes
                return
            if own + nbytes > self.max_bytes:
                raise APIError(400, f"this request's images need more than {own + nbytes:,} "
                               f"bytes once decoded and preprocessed; the server holds at "
                               f"most {self.max_bytes:,} (--max-queued-image-bytes): send "
                               "fewer or smaller images", "messages", "images_too_large")
            self.refused += 1
            raise APIError(503, f"the images of queued requests fill the server's image "
                           f"budget ({self.used:,} of {self.max_bytes:,} bytes); retry later",
                           None, "image_budget_full", RETRY_AFTER_S)

    def _give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class RequestImages:
    """One request's charges: what it holds counts towards the 400 of a request that could
    never fit."""

    def __init__(self, budget: ImageBudget):
        self.budget = budget
        self.held = 0

    @contextmanager
    def reserving(self) -> Iterator[Callable[[int], None]]:
        """A function that charges bytes (a decoded picture's, from its header, before it is
        decoded) until the block ends."""
        taken = 0

        def reserve(nbytes: int) -> None:
            nonlocal taken
            self._take(nbytes)
            taken += nbytes

        try:
            yield reserve
        finally:
            self.held -= taken
            self.budget._give(taken)

    def tie(self, array: Any, nbytes: int) -> None:
        """`nbytes` charged until `array` (an image's frames) is freed."""
        self._take(nbytes)
        weakref.finalize(array, self.budget._give, nbytes)

    def _take(self, nbytes: int) -> None:
        self.budget._take(nbytes, self.held)
        self.held += nbytes
