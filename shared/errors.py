"""The project's error types. The services map them to status codes in one table (services/grpc_errors.py);
any other exception is a bug: INTERNAL with a generic message, its traceback in the log.

A message is public: it says what is wrong in the caller's terms and may name a tier and an instance id, never
an internal address or a Python exception repr. Some types also derive from the built-in they refine
(InvalidRequestError is a ValueError, NoCapacityError a MemoryError), so code that catches the built-in keeps
working; the table matches only these types, never the bare built-ins.
"""
from __future__ import annotations


class TandemError(Exception):
    """Base of every error a client may see."""


class InvalidRequestError(TandemError, ValueError):
    """The request itself is wrong (empty prompt, too long, bad sampling values, mismatched KV): the client's
    fault, not worth retrying elsewhere."""


class UnknownRequestError(TandemError, LookupError):
    """The request id is not (or no longer) known on this instance."""

    def __str__(self) -> str:  # LookupError would quote its argument like a KeyError
        return str(self.args[0]) if self.args else "unknown request"


class NoCapacityError(TandemError, MemoryError):
    """This instance has no room for the request now (KV blocks); another instance, or later, may have.
    room_soon: room will come here shortly without any request finishing (requests of lower priority hold
    blocks while their KV arrives; once decoding they can be preempted), so the caller may wait for it."""

    def __init__(self, message: str, room_soon: bool = False):
        super().__init__(message)
        self.room_soon = room_soon


class NoInstanceError(TandemError):
    """No live instance of a tier can take the request (none registered, or all failed)."""


class UpstreamError(TandemError):
    """A call to another tier failed.

    status: the gRPC status name to pass on ("UNAVAILABLE", "INVALID_ARGUMENT", ...), a string so that this
    module stays free of gRPC. The message names the tier and instance id, never its address.
    """

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class RequestFailedError(TandemError):
    """The engine failed this request (non-finite logits, a failed step); other requests go on."""


class DeadlineError(TandemError):
    """The request ran out of time (its deadline passed before it finished)."""


class UnknownLoRAError(InvalidRequestError):
    """A request or command names a LoRA adapter this instance does not serve (the HTTP API's 404 for an unknown
    model)."""
