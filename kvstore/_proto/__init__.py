"""Generated gRPC stubs; do not edit (python -m kvstore.protogen)."""
