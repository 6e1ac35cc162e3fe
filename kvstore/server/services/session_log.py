"""The Data service's session-log calls (AppendTokens, GetSession, EndSession): a
mixin of DataService, kept apart because they touch the token log, not pages."""

from __future__ import annotations

from contextlib import nullcontext

import grpc

from kvstore import validate
from kvstore._proto import data_pb2
from kvstore.errors import InvalidRequest
from kvstore.security.interceptor import current_identity
from kvstore.server.services.rpc_errors import unary
from kvstore.server.session_owners import SessionOwners
from kvstore.server.tenancy import Tenancy
from kvstore.server.tenancy.quotas import Quotas
from kvstore.server.tokenlog import TokenLog

MAX_APPEND_TOKENS = 1 << 20


class SessionCalls:
    """Needs ``wal``, ``tenancy``, ``quotas`` and ``session_owners`` of the servicer it is mixed into."""

    wal: TokenLog
    session_owners: SessionOwners
    tenancy: Tenancy
    quotas: Quotas

    @unary
    def AppendTokens(self, request: data_pb2.AppendTokensRequest, context: grpc.ServicerContext) -> data_pb2.AppendTokensResponse:
        ns = validate.namespace_id(request.namespace_id)
        if len(request.tokens) > MAX_APPEND_TOKENS:
            raise InvalidRequest(f"too many tokens in one append: {len(request.tokens)}")
        who = current_identity()
        # a session fenced here (live migration) is refused, counted: FAILED_PRECONDITION naming its owner; only
        # to its tenant (another is refused by tenancy.writing, as for any write into the namespace)
        fence = self.session_owners.writing(ns, request.session_id, "AppendTokens") if self.tenancy.sees(who, ns) else nullcontext()
        with fence, self.tenancy.writing(who, ns), \
                self.quotas.appending(who) as charge:
            length = self.wal.append(ns, request.session_id, request.expected_length, list(request.tokens),
                                     request.prompt_tokens, request.sync, charge)
        return data_pb2.AppendTokensResponse(length=length)

    @unary
    def GetSession(self, request: data_pb2.GetSessionRequest, context: grpc.ServicerContext) -> data_pb2.GetSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        found = self.wal.read(ns, request.session_id) if self.tenancy.may_read(current_identity(), ns) else None
        if found is None:
            return data_pb2.GetSessionResponse(found=False)
        return data_pb2.GetSessionResponse(found=True, prompt_tokens=found[0], tokens=found[1])

    @unary
    def EndSession(self, request: data_pb2.EndSessionRequest, context: grpc.ServicerContext) -> data_pb2.EndSessionResponse:
        ns = validate.namespace_id(request.namespace_id)
        if self.tenancy.may_administer(current_identity(), ns):  # else: as for a session that does not exist
            self.wal.end(ns, request.session_id)
        return data_pb2.EndSessionResponse()
