"""What the proxy keeps of one Generate stream so that another decode node can finish it.

A decode node that dies mid-stream (killed, evicted, its connection reset) leaves the client
with the tokens it was sent. The proxy knows the request and those tokens; pdserve's seeded
sampling is a pure function of (seed, output index) and greedy sampling of the context alone,
so a healthy node asked to continue the answer (GenerateRequest.continuation: the tokens sent,
after the prompt, seeded draws at their output index, max_tokens and min_tokens counting the
whole answer) produces exactly what the dead one would have. The client sees one stream: the
same request id throughout, every token once, one final message whose usage counts the prompt
as sent and the whole answer.

Not resumed (the error goes to the client as it came): n > 1 (the completions interleave). A
structured output goes on where it was: the node continuing it advances the grammar over the
tokens sent first. What a resume does not preserve is listed in docs/deployment.md ("Streams
that survive their node").
"""

from __future__ import annotations

import grpc

from proto.pdserve.v1 import generation_pb2

# How a node that died mid-stream (process gone, connection reset) ends the proxy's call to it.
# DEADLINE_EXCEEDED, CANCELLED and the node's own refusals are never resumed.
NODE_LOST = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL})


class GenerateLedger:
    """One Generate call's request and the tokens the client was sent so far."""

    def __init__(self, request: bytes) -> None:
        self.request = generation_pb2.GenerateRequest.FromString(request)
        self.request_id = self.request.request_id  # the server's, once one answered
        self.own = list(self.request.continuation.ids)  # a continuation the client sent itself
        self.sent: list[int] = []  # tokens passed on to the client
        self.added = 0  # tokens of `sent` that the current call got as continuation
        self.finished = False
        self.resumes = 0

    @property
    def resumable(self) -> bool:
        """Whether another node can finish this answer exactly."""
        sampling = self.request.sampling
        left = sampling.max_tokens - len(self.own) - len(self.sent)
        return not self.finished and sampling.n <= 1 and left >= 1

    def record(self, data: bytes) -> bytes:
        """Note a response the client is about to get; returns it as the client should see it
        (from a resumed call: the first call's request id, usage over the whole answer)."""
        msg = generation_pb2.GenerateResponse.FromString(data)
        self.sent.extend(msg.token_ids)
        if not self.request_id:
            self.request_id = msg.request_id
        if msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
            self.finished = True
        if not self.resumes:
            return data  # the first call's answer passes through byte for byte
        msg.request_id = self.request_id
        if msg.HasField("usage"):
            usage = msg.usage
            usage.prompt_tokens -= self.added  # the continuation is answer, not prompt
            usage.completion_tokens += self.added
            usage.cached_tokens = min(usage.cached_tokens, usage.prompt_tokens)
        return msg.SerializeToString()

    def continuation(self) -> bytes:
        """The request that asks another node for the rest of the answer."""
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        request.request_id = self.request_id
        del request.continuation.ids[:]
        request.continuation.ids.extend([*self.own, *self.sent])
        # the first message carried them already
        request.sampling.ClearField("prompt_logprobs")
        self.added = len(self.sent)
        self.resumes += 1
        return request.SerializeToString()
