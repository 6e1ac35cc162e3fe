"""Thin gRPC servicers: validate a request, call one core method, map errors to statuses."""
