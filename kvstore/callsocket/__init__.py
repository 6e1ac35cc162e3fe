"""The same-host call socket: unary RPCs over a Unix socket without gRPC (DESIGN §11). See README.md.

Empty on purpose: the client imports ``client_sync``/``client_aio`` and never loads the server half.
"""
