"""`kvstore-bench calls`: one unary call on each path the client may take (call socket, runtime hop, gRPC),
from a thread and from a loop."""
