"""Command-line values checked where they are parsed."""

from __future__ import annotations

import pytest

from lockgate.cli import main


@pytest.mark.parametrize("port", ["70000", "-1", "x"])
def test_a_port_out_of_range_is_a_usage_error_not_a_wrapped_port(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A newcomer's run: `serve --port 70000` listened on 4464 (the socket call wraps it), `--port -1` failed with
    "unknown error -8", `sim --port 70001` with an OverflowError traceback."""
    for command in ("serve", "sim"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--port", port])
        assert exit_.value.code == 2
        assert "argument --port:" in capsys.readouterr().err
