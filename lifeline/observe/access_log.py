"""The JSON access log: one line per request on the `lifeline.access` logger."""
from __future__ import annotations

import logging
import sys
from typing import TextIO

from lifeline.observe.record import RequestRecord

LOGGER_NAME = "lifeline.access"


class AccessLog:
    def __init__(self, logger: logging.Logger | None = None):
        self.logger = logger or logging.getLogger(LOGGER_NAME)

    def write(self, record: RequestRecord) -> None:
        """Log one finished request as a JSON line at INFO."""
        if self.logger.isEnabledFor(logging.INFO):
            self.logger.info(record.access_log_line())

    @staticmethod
    def configure(target: str | TextIO | None = None) -> logging.Handler:
        """Send the access log, bare JSON lines, to a file path or stream (stderr by default),
        and nowhere else."""
        if isinstance(target, str):
            handler: logging.Handler = logging.FileHandler(target, encoding="utf-8")
        else:
            handler = logging.StreamHandler(target or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger(LOGGER_NAME)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        return handler
