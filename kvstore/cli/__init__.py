"""Command-line entry points: kvstore-server, kvstore-ctl."""
