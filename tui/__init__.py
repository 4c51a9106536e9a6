"""ds4d's operator console: a Textual client of the daemon's GET /v1/ds4d/stats.

This package talks HTTP (or reads a recorded stats log) and imports neither torch nor the ds4d
package, so it runs on any machine that can reach the daemon. Entry point: tui.app:main.
"""
