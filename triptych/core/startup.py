"""The startup log: what a server says while its workers load and once each model is ready.

``triptych serve`` shows this logger's INFO lines (the others stay at WARNING), so a bare ``serve``
says what it is waiting for instead of staying silent until ``/health`` answers. The lines are
written where the events happen: each local worker's spawn (``deploy.launch``), each worker's
registration (``control.orchestrator``), each model's last one.
"""

from __future__ import annotations

import logging

STARTUP_LOGGER = "triptych.startup"
startup_log = logging.getLogger(STARTUP_LOGGER)
