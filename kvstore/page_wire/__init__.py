"""A page on the wire, defined once (DESIGN §4, §8, §12.3).

``grpc_chunks``: a page as PageChunk messages on the gRPC streams (ReadPages, WritePages; a client's, and
a node's fetch over gRPC), encoded and decoded without copying through protobuf, and put back together
(``ChunkedPage``) by the server's WritePages, the client (``kvstore.client.page_assembler``) and the
remote tier. ``fetch_frames``: the node-to-node fetch protocol's frames (hello, request, answer; the
VERSION and the DESCRIBE/VERIFY flags), which both data planes (UCX, TCP) speak; what the transports
share beyond the frames is ``kvstore.cluster.page_fetch``. Empty on purpose: import the module you need.
"""
