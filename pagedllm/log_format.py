"""The one log format of everything the server prints: pagedllm's own loggers, uvicorn's
error and access loggers, and the engine core process.

A leaf module (no imports from pagedllm) so that the core process and the HTTP server share
it without either importing the other. Operators grep and ship one kind of line: time,
level, logger name, message.
"""

from __future__ import annotations

import logging
import logging.config

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_config(level: str | int = "INFO") -> dict:
    """A `logging.config.dictConfig` dict: one stderr handler with LOG_FORMAT on the root
    logger, and uvicorn's loggers sending their records there (uvicorn's own config would
    give them two other formats, one of them coloured). Given to uvicorn as its
    `log_config`, so that uvicorn applying it changes nothing."""
    if isinstance(level, int):
        level = logging.getLevelName(level)
    level = str(level).upper()
    inherit = {"handlers": [], "propagate": True}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": {"format": LOG_FORMAT}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default",
                                 "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["default"], "level": level},
        "loggers": {"uvicorn": {**inherit, "level": level},
                    "uvicorn.error": dict(inherit),
                    "uvicorn.access": dict(inherit)},
    }


def configure_logging(level: str | int = "INFO") -> dict:
    """Apply `log_config(level)` to this process; returns the dict (for uvicorn)."""
    config = log_config(level)
    logging.config.dictConfig(config)
    return config
