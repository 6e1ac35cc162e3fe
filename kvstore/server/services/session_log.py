"""The Data service's session-log calls (AppendTokens, GetSession, EndSession): a
mixin of DataService, kept apart because they touch the token log, not pages."""

from __future__ import annotations

import grpc

from kvstore import validate
from kvstore._proto import data_pb2
from kvstore.errors import InvalidRequest
from kvstore.security.interceptor import current_identity
from kvstore.server.services.rpc_errors import unary
from kvstore.server.tenancy.gate import Gate

MAX_APPEND_TOKENS = 1 << 20


class SessionCalls:
    """Needs ``gate`` of the servicer it is mixed into."""

    gate: Gate

    @unary
    def AppendTokens(self, request: data_pb2.AppendTokensRequest, context: grpc.ServicerContext) -> data_pb2.AppendTokensResponse:
        ns = validate.namespace_id(request.namespace_id)
        if len(request.tokens) > MAX_APPEND_TOKENS:
            raise InvalidRequest(f"too many tokens in one append: {len(request.tokens)}")
        length = self.gate.append_tokens(current_identity(), ns, request.session_id, request.expected_length, list(request.tokens),
                                         request.prompt_tokens, request.sync)
        return data_pb2.AppendTokensResponse(length=length)

    @unary
    def GetSession(self, request: data_pb2.GetSessionRequest, context: grpc.ServicerContext) -> data_pb2.GetSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        found = self.gate.read_session(current_identity(), ns, request.session_id)
        if found is None:
            return data_pb2.GetSessionResponse(found=False)
        return data_pb2.GetSessionResponse(found=True, prompt_tokens=found[0], tokens=found[1])

    @unary
    def EndSession(self, request: data_pb2.EndSessionRequest, context: grpc.ServicerContext) -> data_pb2.EndSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        self.gate.end_session(current_identity(), ns, request.session_id)
        return data_pb2.EndSessionResponse()
