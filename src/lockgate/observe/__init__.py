"""What operators see beyond `/metrics`: the access log, W3C trace context and optional OpenTelemetry spans.

Configuration of these (and of the admin API's keys) lives in `observe/config.py`; `config.py` embeds it.
"""
